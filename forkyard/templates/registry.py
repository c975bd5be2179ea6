"""Images from OCI registries (Docker Hub, any registry by name) as rootfs templates,
pulled with Debian's ``skopeo`` (containers/image: registry protocol, auth, retries,
digest verification) and unpacked by :func:`forkyard.templates.build_oci.import_image`
(the safe layer applier of ``POST /templates/import``: whiteouts, hard links, owners,
paths kept inside the rootfs, the ``FORKYARD_MAX_UNPACKED_*`` caps; it checks every blob
against its digest again as it reads it).

A pull (:meth:`Puller.pull`):

1. resolves the reference to a manifest digest (``skopeo inspect --raw``: the manifest's
   sha256; a reference with ``@sha256:…`` must match it), so the tag cannot move under
   the rest of the pull;
2. if rootfs template ``oci-<first 32 hex of that digest>`` is already unpacked here,
   uses it (a second build from the same image pulls nothing but the manifest);
3. else copies ``REPO@DIGEST`` for this host's platform into a fresh OCI layout whose
   blobs live in the node's shared layer cache ``<data_dir>/image-cache/blobs/sha256/``
   (``skopeo copy --dest-shared-blob-dir``: blobs already there are not fetched again;
   skopeo verifies every fetched blob's digest and keeps nothing it could not verify),
   unpacks it as that template, and evicts the least recently used cached blobs past
   ``FORKYARD_IMAGE_CACHE_MB`` (never those of the image just pulled).

Pulls on one node run one at a time (the cache's eviction and the unpacking into one
template directory stay consistent). Credentials (E2B's ``fromImageRegistry``
``{"type": "registry", "username", "password"}``) go to skopeo in an auth file of mode
0600 deleted after the call: never on a command line, in a log or in a build record.
Plain HTTP (and unverified TLS) only for loopback registries and those in
``FORKYARD_INSECURE_REGISTRIES``.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from forkyard.config import Settings
from forkyard.orchestrator import images
from forkyard.templates import base as base_tmpl
from forkyard.templates import build_oci

Progress = Callable[[str], None]
#: Longest one skopeo call may take (s): a multi-GB image on a slow link.
PULL_TIMEOUT_S = 1800
INSPECT_TIMEOUT_S = 120
#: Prefix of the rootfs templates pulled images become (hidden from template lists).
PREFIX = "oci-"
DOCKER_HUB = "docker.io"
# distribution/reference's grammar (reference/regexp.go), lower-case path components.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_PATH = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_HOST = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
                   r"|\[[0-9A-Fa-f:]+\])(?::[0-9]{1,5})?$")
_TAG = re.compile(r"^[\w][\w.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


class PullError(Exception):
    """The image could not be pulled; the message says why and what to do."""


@dataclass(frozen=True)
class ImageRef:
    """A normalized image reference: ``registry`` (``docker.io`` or ``host[:port]``),
    ``repository`` (``library/python``), ``tag`` and/or ``digest`` (``sha256:…``)."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    def __str__(self) -> str:
        return f"{self.registry}/{self.repository}" + (f":{self.tag}" if self.tag else "") + (
            f"@{self.digest}" if self.digest else "")

    def transport(self, digest: str | None = None) -> str:
        """skopeo's ``docker://`` name, by ``digest`` when given."""
        at = f"@{digest}" if digest else (f"@{self.digest}" if self.digest else f":{self.tag or 'latest'}")
        return f"docker://{self.registry}/{self.repository}{at}"


@dataclass(frozen=True)
class Credentials:
    """Basic auth for one registry (E2B's ``fromImageRegistry`` of type ``registry``)."""

    username: str
    password: str

    def __repr__(self) -> str:  # never show the password
        return f"Credentials(username={self.username!r}, password=***)"


def parse_reference(image: str) -> ImageRef:
    """``image`` as Docker names it (``python:3.13``, ``ghcr.io/o/r@sha256:…``,
    ``127.0.0.1:5000/x:tag``) normalized as distribution/reference does: no registry
    (the first component holds no ``.``/``:`` and is not ``localhost``) means Docker Hub,
    a one-component Hub name is under ``library/``; no tag and no digest means ``latest``.

    Raises:
        PullError: not a valid reference (the message shows the expected form).
    """
    if not isinstance(image, str) or not image or len(image) > 512 or image != image.strip():
        raise PullError(f"invalid image reference {image!r}")
    rest, digest = image, None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        if not _DIGEST.match(digest):
            raise PullError(f"invalid digest in {image!r}: expected @sha256:<64 hex digits>")
    first, slash, remainder = rest.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        registry, path = first, remainder
    else:
        registry, path = DOCKER_HUB, rest
    if registry in ("index.docker.io", "registry-1.docker.io"):
        registry = DOCKER_HUB
    tag = None
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, tag = path.rsplit(":", 1)
        if not _TAG.match(tag):
            raise PullError(f"invalid tag {tag!r} in {image!r}")
    if registry == DOCKER_HUB and "/" not in path:
        path = f"library/{path}"
    if not _HOST.match(registry) or not _PATH.match(path):
        raise PullError(f"invalid image reference {image!r}: expected [registry/]name[:tag][@sha256:digest] "
                        "(lower-case name)")
    return ImageRef(registry, path, tag if tag or digest else "latest", digest)


def plain_http_allowed(settings: Settings, registry: str) -> bool:
    """True when ``registry`` may be reached over plain HTTP / unverified TLS: a
    loopback address or ``localhost``, or listed in ``FORKYARD_INSECURE_REGISTRIES``."""
    if registry in settings.insecure_registries:
        return True
    host = registry.rsplit(":", 1)[0] if not registry.endswith("]") else registry
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def template_name(digest: str) -> str:
    """The rootfs template a pulled image with manifest ``digest`` becomes."""
    return PREFIX + digest.split(":", 1)[1][:32]


def is_pulled(settings: Settings, name: str) -> bool:
    """True when rootfs template ``name`` is a pulled image (made by :class:`Puller`)."""
    try:
        return name.startswith(PREFIX) and (settings.templates_dir / name / images.MARKER).read_text().startswith(
            "pulled")
    except OSError:
        return False


def remove_pulled(settings: Settings, name: str) -> None:
    """Delete pulled image ``name``'s rootfs template (its cached layers stay, for the
    cache's own eviction). The caller checks nothing uses it.

    Raises:
        PullError: ``name`` is not a pulled image.
    """
    if not is_pulled(settings, name):
        raise PullError(f"{name!r} is not a pulled image")
    tdir = settings.templates_dir / name
    (tdir / images.MARKER).unlink(missing_ok=True)
    base_tmpl.unprotect_rootfs(tdir / "rootfs")
    shutil.rmtree(tdir, ignore_errors=True)


class Puller:
    """Pulls images into rootfs templates on one node, with the layer cache under
    ``<data_dir>/image-cache`` (``blobs/sha256/<hex>``: compressed layers, configs and
    manifests by digest; ``tmp/``: auth files and layouts of pulls in progress).

    Args:
        settings: ``data_dir``, ``templates_dir``, ``image_cache_mb``,
            ``insecure_registries`` and the unpack limits.
        skopeo: the skopeo executable (name looked up on ``PATH``, or a path).

    Creating one removes ``tmp/`` (what a server stopped mid-pull left there).
    """

    def __init__(self, settings: Settings, skopeo: str = "skopeo"):
        self.settings = settings
        self.skopeo = skopeo
        self.root = settings.data_dir / "image-cache"
        self.blobs = self.root / "blobs"
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._cancelled = False
        # what a server stopped mid-pull left: layouts and (holding credentials) auth files
        shutil.rmtree(self.root / "tmp", ignore_errors=True)

    def pull(self, image: str, creds: Credentials | None = None, progress: Progress = lambda line: None) -> str:
        """Pull ``image`` (with ``creds`` when given) and return the name of the rootfs
        template that holds it (existing or new). Blocking: call it in a thread.

        Raises:
            PullError: bad reference, registry unreachable, refused credentials, image or
                digest not found, a blob that does not match its digest, plain HTTP to a
                registry that must use HTTPS, skopeo missing. Nothing half-made is left.
            build_oci.ImageImportError / unpack.LimitExceeded: the image's layers cannot
                be applied (bad layer, past a ``FORKYARD_MAX_UNPACKED_*`` limit).
        """
        ref = parse_reference(image)
        if shutil.which(self.skopeo) is None:
            raise PullError("registry pulls need skopeo on the node (apt-get install skopeo; deploy/install.sh "
                            "installs it)")
        with self._lock:
            for d in (self.root, self.blobs, self.root / "tmp"):
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
            started = time.time()
            auth = self._authfile(ref, creds)
            try:
                progress(f"Resolving {ref}")
                raw = self._run(["inspect", "--raw", *self._src_flags(ref, auth, "")],
                                ref.transport(), ref, creds, INSPECT_TIMEOUT_S)
                digest = "sha256:" + hashlib.sha256(raw).hexdigest()
                if ref.digest and ref.digest != digest:
                    raise PullError(f"{ref}: the registry's manifest has digest {digest}, not the one asked for")
                name = template_name(digest)
                if images.resolve(self.settings, name) is not None:
                    progress(f"Image {ref.registry}/{ref.repository}@{digest} is already unpacked on this node")
                    return name
                layout = self.root / "tmp" / f"layout-{secrets.token_hex(6)}"
                try:
                    progress(f"Pulling {ref.registry}/{ref.repository}@{digest}")
                    self._run(["copy", "--quiet", "--retry-times", "2", *self._src_flags(ref, auth, "src-"),
                               "--dest-shared-blob-dir", str(self.blobs)],
                              ref.transport(digest), ref, creds, PULL_TIMEOUT_S, extra=[f"oci:{layout}:image"])
                    build_oci.import_image(self.settings, layout, name, progress, blobs_dir=self.blobs,
                                           origin=f"pulled from {ref.transport(digest)}", provision_user=True)
                finally:
                    shutil.rmtree(layout, ignore_errors=True)
                return name
            finally:
                if auth is not None:
                    auth.unlink(missing_ok=True)
                self.evict(keep_since=started)

    def evict(self, keep_since: float = 0.0) -> int:
        """Remove the least recently used cached blobs until the cache holds at most
        ``FORKYARD_IMAGE_CACHE_MB``; blobs used at or after ``keep_since`` (epoch s)
        stay. Returns the bytes freed."""
        cap = self.settings.image_cache_mb << 20
        try:
            files = [(p.stat(), p) for p in (self.blobs / "sha256").iterdir() if p.is_file()]
        except OSError:
            return 0
        total = sum(st.st_size for st, _ in files)
        freed = 0
        for st, p in sorted(files, key=lambda x: x[0].st_mtime):
            if total - freed <= cap:
                break
            if st.st_mtime >= keep_since:
                continue
            p.unlink(missing_ok=True)
            freed += st.st_size
        return freed

    # ---- skopeo -------------------------------------------------------------------------
    def _src_flags(self, ref: ImageRef, auth: Path | None, prefix: str) -> list[str]:
        flags = [f"--{prefix}authfile", str(auth)] if auth is not None else [f"--{prefix}no-creds"]
        if plain_http_allowed(self.settings, ref.registry):
            flags.append(f"--{prefix}tls-verify=false")
        return flags

    def _authfile(self, ref: ImageRef, creds: Credentials | None) -> Path | None:
        if creds is None:
            return None
        path = self.root / "tmp" / f"auth-{secrets.token_hex(8)}.json"
        token = base64.b64encode(f"{creds.username}:{creds.password}".encode()).decode()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"auths": {ref.registry: {"auth": token}}}, f)
        return path

    def _run(self, args: list[str], source: str, ref: ImageRef, creds: Credentials | None, timeout_s: float,
             extra: list[str] = ()) -> bytes:
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(self.root / "tmp"),
               "XDG_RUNTIME_DIR": str(self.root / "tmp")}
        if self._cancelled:
            raise PullError("the server is stopping")
        proc = subprocess.Popen([shutil.which(self.skopeo) or self.skopeo, *args, source, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, stdin=subprocess.DEVNULL)
        self._proc = proc
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise PullError(f"pulling {ref} took longer than {timeout_s:.0f} s (registry {ref.registry} too slow?)") \
                from None
        finally:
            self._proc = None
        if self._cancelled:
            raise PullError("the server is stopping")
        if proc.returncode == 0:
            if len(out) > build_oci.MAX_JSON_BYTES:
                raise PullError(f"{ref}: the manifest is larger than {build_oci.MAX_JSON_BYTES} bytes")
            return out
        raise PullError(explain(err.decode(errors="replace"), ref, creds))

    def cancel(self) -> None:
        """Stop the pull in progress (its skopeo is killed) and refuse new ones: for a
        server that is stopping."""
        self._cancelled = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()


def explain(stderr: str, ref: ImageRef, creds: Credentials | None) -> str:
    """A user-facing message (what went wrong, what to do) for skopeo's ``stderr``;
    the password never appears in it."""
    text = stderr
    if creds is not None and creds.password:
        text = text.replace(creds.password, "***")
    low = text.lower()
    detail = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "no output")
    detail = re.sub(r'^time="[^"]*" level=\w+ msg="(.*)"$', r"\1", detail).replace('\\"', '"')[:600]
    reg = ref.registry
    if "server gave http response to https client" in low:
        return (f"registry {reg} speaks plain HTTP; forkyard pulls over plain HTTP only from loopback registries "
                f"and those in FORKYARD_INSECURE_REGISTRIES ({detail})")
    if "unauthorized" in low or "authentication required" in low or "denied" in low or " 401" in low:
        if creds is not None:
            return (f"registry {reg} refused the credentials for {ref.repository}: check the username and password "
                    f"given to from_image(..., username=, password=) ({detail})")
        return (f"registry {reg} requires authentication for {ref.repository} (or it does not exist): pass "
                f"from_image(..., username=, password=) ({detail})")
    if "digest" in low and ("mismatch" in low or "did not match" in low or "does not match" in low):
        return (f"a blob of {ref} does not match its digest: the registry served corrupt data; nothing was kept, "
                f"retry or fix the registry ({detail})")
    # "404" as a word: the digests skopeo prints are hex, and one in 15 or so holds "404"
    if "manifest unknown" in low or "not found" in low or "name unknown" in low or re.search(r"\b404\b", low):
        return f"image {ref} not found in registry {reg}: check the name, tag or digest ({detail})"
    if any(s in low for s in ("connection refused", "no such host", "i/o timeout", "network is unreachable",
                              "dial tcp", "no route to host", "tls handshake timeout", "connection reset")):
        return (f"cannot reach registry {reg}: check its address and that this node can connect to it "
                f"({detail})")
    if "x509" in low or "certificate" in low:
        return (f"registry {reg}'s TLS certificate is not trusted by this node: install its CA, or list it in "
                f"FORKYARD_INSECURE_REGISTRIES if it is yours ({detail})")
    return f"pulling {ref} failed: {detail}"
