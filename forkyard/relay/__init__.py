"""Relaying HTTP and WebSocket traffic to an upstream that is a sandbox (the node's
sandbox proxy, :mod:`forkyard.api.proxy`) or a node (the cluster gateway).

The library both share, below both: it knows HTTP, Connect framing and E2B's proxy
answers, and nothing of sandboxes, orchestrators or clusters (it imports only the
ground: ``config``). Who is behind an upstream address is the caller's business; a
caller passes ``gone()`` to say, when a connection fails, whether its target went away.

* :mod:`.headers`: hop-by-hop headers, the request target as received;
* :mod:`.paths`: the one rule for REST paths, envd's routes only the orchestrator calls;
* :mod:`.errors`: the relays' answers when the upstream fails, :class:`~.errors.UpstreamCut`;
* :mod:`.upstream`: plain asyncio sockets under httpx, one connection set per upstream;
* :mod:`.http`: the general relay (bodies streamed both ways, Connect end-of-stream errors);
* :mod:`.fastpath` + :mod:`.zerocopy`: requests without a body, socket to socket (``splice``);
* :mod:`.websocket`: WebSocket sessions frame by frame.
"""
