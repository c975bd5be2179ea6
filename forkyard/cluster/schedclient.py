"""Calls to the scheduler, with failover between its replicas.

``FORKYARD_SCHEDULER_URL`` may name several replicas (``http://a:9090,http://b:9090``):
a call goes to the replica that answered last; when that one cannot be reached it is
tried on the next, so one replica killed or stopped costs a node's heartbeat at most
one timeout, not its liveness. Behind a load balancer (Kubernetes Service) give one URL.
"""

from __future__ import annotations

import httpx

from forkyard.cluster.config import SECRET_HEADER, scheduler_urls


class SchedulerClient:
    """Async HTTP client for the scheduler replicas at ``urls``.

    Args:
        urls: a comma-separated string or a list of base URLs.
        secret: the credential sent on every call: the cluster secret (gateway, CLI) or
            a node's own key (:mod:`.nodekeys`).
        headers: more headers for every call (a node's :data:`~.nodekeys.NODE_URL_HEADER`).
        timeout_s: default timeout of a call (s); connecting gets at most a second of it.
    """

    def __init__(self, urls: str | list[str], secret: str, timeout_s: float = 5.0,
                 headers: dict[str, str] | None = None):
        self.urls = scheduler_urls(urls) if isinstance(urls, str) else list(urls)
        self._i = 0
        #: the headers of every call (credential included: never log them)
        self.headers = {**(headers or {}), SECRET_HEADER: secret}
        self._http = httpx.AsyncClient(headers=self.headers, trust_env=False,
                                       timeout=httpx.Timeout(timeout_s, connect=min(1.0, timeout_s)))

    @property
    def url(self) -> str:
        """The replica used last."""
        return self.urls[self._i]

    async def request(self, method: str, path: str, idempotent: bool = True, **kw) -> httpx.Response:
        """``method path`` on the current replica, then on the others in turn when it
        cannot be reached (for non-``idempotent`` calls only when the connection was
        refused or timed out before any byte went out). ``kw`` as ``httpx.request``
        (``json``, ``headers``, ``timeout``).

        Raises:
            httpx.HTTPError: no replica could be reached (the last error).
        """
        last: Exception | None = None
        for k in range(len(self.urls)):
            i = (self._i + k) % len(self.urls)
            try:
                r = await self._http.request(method, self.urls[i] + path, **kw)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                last = e
                continue
            except httpx.TransportError as e:  # read timeout, connection dropped mid-call
                last = e
                if idempotent:
                    continue
                raise
            self._i = i
            return r
        assert last is not None
        raise last

    async def post(self, path: str, **kw) -> httpx.Response:
        """``POST path`` (see :meth:`request`)."""
        return await self.request("POST", path, **kw)

    async def aclose(self) -> None:
        """Close the connections."""
        await self._http.aclose()
