"""A node's settings: the server (:class:`Settings`), what its host admits
(:class:`AdmissionSettings`), the gVisor driver's tunables (:class:`GVisorSettings`), and
the fixed in-sandbox constants (envd's port and version, the guest's addresses)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from forkyard.config._env import _env, _env_bool, _env_choice, _env_cidrs, _env_on, _env_path
from forkyard.ids import NAME

#: Port envd listens on inside every sandbox (E2B SDK ``ConnectionConfig.envd_port``).
ENVD_PORT = 49983
#: envd version we report; the E2B SDK gates features on it (e2b/envd/versions.py).
ENVD_VERSION = "0.6.4"
#: Fixed in-sandbox addressing: every sandbox sees the same guest IP and gateway.
GUEST_IP = "169.254.0.21"
GUEST_GATEWAY = "169.254.0.22"
GUEST_PREFIXLEN = 30

#: ``FORKYARD_POOL`` when unset: two idle ``base`` sandboxes (~20-40 MiB of host memory
#: each, 2 × the default memory limit held in admission; docs/runtime.md).
DEFAULT_POOL = "base:2"
_POOL_ENTRY = re.compile(rf"^({NAME}):(\d{{1,3}})$")
#: Most pooled sandboxes per template (a typo such as ``base:200`` should not start 200).
POOL_MAX_PER_TEMPLATE = 64


def parse_pool(raw: str | None, name: str = "FORKYARD_POOL") -> dict[str, int]:
    """``"base:2,other:1"`` → ``{"base": 2, "other": 1}``; ``""``, ``"0"`` or ``"off"``
    → ``{}`` (no pool). Sizes are 0 … :data:`POOL_MAX_PER_TEMPLATE`.

    Raises:
        ValueError: a malformed entry or a size out of range (naming ``name``).
    """
    raw = (raw or "").strip()
    if raw.lower() in ("", "0", "off", "false", "none"):
        return {}
    out: dict[str, int] = {}
    for part in (p.strip() for p in raw.split(",")):
        if not part:
            continue
        m = _POOL_ENTRY.match(part)
        if m is None:
            raise ValueError(f"{name}: {part!r} is not TEMPLATE:SIZE (e.g. base:2)")
        size = int(m.group(2))
        if size > POOL_MAX_PER_TEMPLATE:
            raise ValueError(f"{name}: {part!r}: at most {POOL_MAX_PER_TEMPLATE} pooled sandboxes per template")
        if size:
            out[m.group(1)] = size
    return out



#: Where ``deploy/runsc/build.sh`` installs the pinned, patched gVisor build (a link to
#: ``runsc-<build>`` beside it); see docs/runtime.md.
DEFAULT_RUNSC = "/usr/local/lib/forkyard/runsc"


@dataclass
class Settings:
    """Server settings.

    Attributes:
        data_dir: root of all state (``FORKYARD_DATA_DIR``, default ``/var/lib/forkyard``).
        host/port: API bind address (``FORKYARD_HOST`` 127.0.0.1, ``FORKYARD_PORT`` 3000).
        runsc: the runsc binary (``FORKYARD_RUNSC``, default :data:`DEFAULT_RUNSC`, the
            pinned build ``deploy/runsc/build.sh`` installs); a bare name is looked up in
            PATH. Resolved to an absolute file once when the runtime driver starts.
        envd_binary: static envd binary injected into sandboxes (``FORKYARD_ENVD``,
            default ``<repo>/envd/bin/envd``).
        default_vcpu / default_memory_mb: per-sandbox limits (2 vCPU, 512 MiB — E2B defaults).
        default_disk_mb: each sandbox's disk (its writable layer; ``FORKYARD_DISK_MB``,
            4096; 0 = unbounded) unless its template says otherwise (``diskSizeMB``):
            writes beyond it fail with ENOSPC inside.
        max_disk_mb: the largest disk a template may ask for (``FORKYARD_MAX_DISK_MB``,
            20480 — forkyard's choice; a larger ``diskSizeMB`` is a 400).
        fs_image_memory_fraction: a filesystem-only pause or snapshot is refused (409)
            when its image (the changed files, sparse files at their full size) exceeds
            this fraction of the sandbox's memory (``FORKYARD_FS_IMAGE_MEMORY_FRACTION``,
            0.2; or 90 % of its disk, whichever is less): runsc lays the image back inside
            the sandbox's memory limit at resume. Measured (512 MiB, runsc 20260905):
            a 100 MiB file resumed, 150 MiB got the boot OOM-killed. No E2B equivalent
            (E2B keeps a VM disk).
        console_log_max_bytes: what one sandbox's console log (envd's log and anything
            written to its stdio inside, :mod:`forkyard.runtime.gvisor.console`) may hold
            on the host, ``console.log`` and its older half ``console.log.1`` together
            (``FORKYARD_CONSOLE_LOG_MAX_BYTES``, 8388608 = 8 MiB; the newest bytes are
            kept). Per sandbox and outside its disk size, so a node's consoles take at
            most this times its sandboxes. No E2B equivalent (E2B's envd ships its log
            over HTTP to a collector).
        net_prefix: 2-4 letters naming this server's netns/veths/iptables chains
            (``FORKYARD_NET_PREFIX``, ``fy``); two servers on one host need different ones.
        outer_net: IPv4 range for per-sandbox outer addresses, one /30 each
            (``FORKYARD_OUTER_NET``, 10.209.0.0/16).
        max_upload_mb: largest request body the proxy forwards to a sandbox
            (``FORKYARD_MAX_UPLOAD_MB``, 4096); larger ones get 413.
        max_unpacked_mb / max_unpacked_files / max_unpacked_file_mb: what one untrusted
            archive — an imported image (its layers together), a build ``COPY`` upload,
            a pulled image — may unpack to (:mod:`forkyard.templates.unpack`):
            bytes, sparse files at their apparent size (``FORKYARD_MAX_UNPACKED_MB``,
            16384: an upload at ``FORKYARD_MAX_UPLOAD_MB`` gzipped about 4:1, as image
            layers are); entries (``FORKYARD_MAX_UNPACKED_FILES``, 1000000: large
            images hold 50k–500k); one file (``FORKYARD_MAX_UNPACKED_FILE_MB``, 8192).
            Past one the call answers 413 naming the setting. E2B has no such settings
            (its builds run in VMs with their own disks).
        image_cache_mb: bytes (MiB) of compressed image layers pulled from registries
            that this node keeps for later builds (``FORKYARD_IMAGE_CACHE_MB``, 20480),
            under ``<data_dir>/image-cache`` (:mod:`forkyard.templates.registry`); the
            least recently used go first after each pull.
        insecure_registries: registries (``host[:port]``) pulled from over plain HTTP
            or with unverified TLS (``FORKYARD_INSECURE_REGISTRIES``, comma-separated;
            loopback registries always are); any other registry must speak verified HTTPS.
        domain: public sandbox domain (``FORKYARD_DOMAIN``, e.g. ``sbx.example.com`` with
            a wildcard DNS record ``*.sbx.example.com`` pointing at this server or the
            gateway; may carry a ``:port``). Returned as ``domain`` by create/connect, so
            the SDKs' ``get_host(port)`` is ``PORT-ID.DOMAIN``. Unset: ``localhost:PORT``
            (curl and browsers resolve ``*.localhost`` to loopback). See
            :attr:`public_domain`.
        default_auto_pause: what a sandbox created without ``autoPause`` does at its
            timeout (``FORKYARD_DEFAULT_AUTO_PAUSE``, ``true``): pause (true, forkyard's
            default) or kill (false, E2B's default).
        short_timeout_kill_s: a sandbox whose pause-at-timeout came from
            :attr:`default_auto_pause` (its creator sent no ``autoPause``) and whose
            timeout a client then sets to at most this many seconds is killed at that
            timeout, as on E2B, instead of paused (``FORKYARD_SHORT_TIMEOUT_KILL_S``, 2;
            0: never). The E2B CLI ends ``e2b sandbox create``'s terminal with a 1 s
            timeout, expecting the kill.
        blocked_egress: IPv4 CIDRs no sandbox may reach whatever its egress policy
            (``FORKYARD_BLOCKED_EGRESS``, comma-separated; None = the built-in list of
            private, link-local/metadata, CGNAT, documentation and multicast ranges in
            :data:`forkyard.network.firewall.BLOCKED_EGRESS`). Replacing it lets sandboxes
            reach e.g. a private package mirror.
        tls_cert / tls_key: PEM certificate (chain) and key files (``FORKYARD_TLS_CERT``,
            ``FORKYARD_TLS_KEY``): when both are set the server speaks HTTPS only on its
            port, so ``https://PORT-ID.DOMAIN`` works as the SDKs build it (the
            certificate should cover ``*.DOMAIN``).
        cluster: this node is part of a cluster (set by ``forkyard node --scheduler``):
            pauses commit to the shared repository before they answer (so a paused
            sandbox can resume on any node even if this one dies right after), and
            only images this node itself made garbage are deleted (other nodes' pause
            images live in the same repository).
        hot_pause_s / hot_pause_max: a paused sandbox's frozen runtime is kept this many
            seconds (``FORKYARD_HOT_PAUSE_S``, 60; 0 disables) by at most this many
            sandboxes (``FORKYARD_HOT_PAUSE_MAX``, 32), so resuming it is an unfreeze
            (:mod:`forkyard.orchestrator.hot`); never in a cluster.
        pool: warm pool size per rootfs template (``FORKYARD_POOL``, ``base:2``;
            ``TEMPLATE:N,…``; ``off`` or ``0`` disables): sandboxes started ahead so a
            create is a hand-out (:mod:`forkyard.orchestrator.pool`); never in a cluster
            (E2B has no such setting: its orchestrator starts every sandbox on demand).
        spare_slots: network slots kept built ahead of demand (``FORKYARD_SPARE_SLOTS``,
            16): a start takes one instead of spending ~25 ms of CPU creating a netns,
            veths and NAT rules (E2B's orchestrator keeps a similar pool of slots).
        paused_retention_s: how long a paused sandbox is kept before it and its image
            are deleted (``FORKYARD_PAUSED_RETENTION_S``, 30 days).
        fork_image_ttl_s: in a cluster, a ``fork`` image older than this is deleted by
            any node's image GC (``FORKYARD_FORK_IMAGE_TTL_S``, 3600): the gateway
            deletes each once the fork's children run, so an older one was left by a
            gateway that died mid-fork.
        max_volumes: E2B volumes a node keeps at most (``FORKYARD_MAX_VOLUMES``, 64;
            more: 400).
        volume_size_mb: the size of each volume (``FORKYARD_VOLUME_SIZE_MB``, 1024 MiB;
            E2B sizes volumes per team and the SDK asks for none).
        volumes_root_override: where the volumes' images and rows live
            (``FORKYARD_VOLUMES_DIR``; None: ``<data_dir>/volumes``, :attr:`volumes_root`). In a cluster every node names the same
            shared directory (NFS or another shared mount), so a volume is reachable from
            every node; each node mounts an image only while it holds the volume's lease
            (:mod:`forkyard.cluster.volumes`).
        volume_idle_s: in a cluster, a volume no sandbox of this node mounts (running or
            paused) and no content-API call used for this long (s) is unmounted and its
            lease given back, so another node can take it (``FORKYARD_VOLUME_IDLE_S``, 30).
        volume_lease_wait_s: how long a resume or restore waits for another node to give
            a volume's lease back before it fails with 409 (``FORKYARD_VOLUME_LEASE_WAIT_S``, 15).
        fork_parallelism: restores a fork runs at once (``FORKYARD_FORK_PARALLELISM``,
            16). Measured on 2 cores, fork ×16: 4 → ~1.91 s, 8 → ~1.77–1.99 s, 16 →
            ~1.80 s (bench/bench_lifecycle.py).
    """

    data_dir: Path = field(default_factory=lambda: _env_path("FORKYARD_DATA_DIR", "/var/lib/forkyard"))
    host: str = field(default_factory=lambda: os.environ.get("FORKYARD_HOST", "127.0.0.1"))
    port: int = field(default_factory=lambda: int(os.environ.get("FORKYARD_PORT", "3000")))
    runsc: str = field(default_factory=lambda: os.environ.get("FORKYARD_RUNSC", DEFAULT_RUNSC))
    envd_binary: Path = field(
        default_factory=lambda: _env_path(
            "FORKYARD_ENVD", str(Path(__file__).resolve().parents[2] / "envd" / "bin" / "envd")
        )
    )
    default_vcpu: int = 2
    default_memory_mb: int = 512
    default_disk_mb: int = field(default_factory=lambda: int(os.environ.get("FORKYARD_DISK_MB", "4096")))
    max_disk_mb: int = field(default_factory=lambda: int(os.environ.get("FORKYARD_MAX_DISK_MB", "20480")))
    fs_image_memory_fraction: float = field(
        default_factory=lambda: float(os.environ.get("FORKYARD_FS_IMAGE_MEMORY_FRACTION", "0.2")))
    console_log_max_bytes: int = field(
        default_factory=lambda: max(4096, int(os.environ.get("FORKYARD_CONSOLE_LOG_MAX_BYTES", str(8 << 20)))))
    net_prefix: str = field(default_factory=lambda: os.environ.get("FORKYARD_NET_PREFIX", "fy"))
    outer_net: str = field(default_factory=lambda: os.environ.get("FORKYARD_OUTER_NET", "10.209.0.0/16"))
    max_upload_mb: int = field(default_factory=lambda: int(os.environ.get("FORKYARD_MAX_UPLOAD_MB", "4096")))
    max_unpacked_mb: int = field(default_factory=lambda: int(os.environ.get("FORKYARD_MAX_UNPACKED_MB", "16384")))
    max_unpacked_files: int = field(
        default_factory=lambda: int(os.environ.get("FORKYARD_MAX_UNPACKED_FILES", "1000000")))
    max_unpacked_file_mb: int = field(
        default_factory=lambda: int(os.environ.get("FORKYARD_MAX_UNPACKED_FILE_MB", "8192")))
    image_cache_mb: int = field(default_factory=lambda: int(os.environ.get("FORKYARD_IMAGE_CACHE_MB", "20480")))
    insecure_registries: list[str] = field(default_factory=lambda: [
        h.strip() for h in os.environ.get("FORKYARD_INSECURE_REGISTRIES", "").split(",") if h.strip()])
    domain: str = field(default_factory=lambda: os.environ.get("FORKYARD_DOMAIN", ""))
    default_auto_pause: bool = field(default_factory=lambda: _env_bool("FORKYARD_DEFAULT_AUTO_PAUSE", True))
    short_timeout_kill_s: int = field(default_factory=lambda: int(os.environ.get("FORKYARD_SHORT_TIMEOUT_KILL_S", "2")))
    blocked_egress: list[str] | None = field(default_factory=lambda: _env_cidrs("FORKYARD_BLOCKED_EGRESS"))
    tls_cert: str | None = field(default_factory=lambda: os.environ.get("FORKYARD_TLS_CERT") or None)
    tls_key: str | None = field(default_factory=lambda: os.environ.get("FORKYARD_TLS_KEY") or None)
    cluster: bool = False
    hot_pause_s: float = field(default_factory=lambda: float(os.environ.get("FORKYARD_HOT_PAUSE_S", "60")))
    hot_pause_max: int = field(default_factory=lambda: int(os.environ.get("FORKYARD_HOT_PAUSE_MAX", "32")))
    pool: dict[str, int] = field(default_factory=lambda: parse_pool(os.environ.get("FORKYARD_POOL", DEFAULT_POOL)))
    spare_slots: int = field(default_factory=lambda: int(os.environ.get("FORKYARD_SPARE_SLOTS", "16")))
    paused_retention_s: int = field(
        default_factory=lambda: int(os.environ.get("FORKYARD_PAUSED_RETENTION_S", str(30 * 24 * 3600))))
    fork_image_ttl_s: float = field(default_factory=lambda: float(os.environ.get("FORKYARD_FORK_IMAGE_TTL_S", "3600")))
    fork_parallelism: int = field(default_factory=lambda: int(os.environ.get("FORKYARD_FORK_PARALLELISM", "16")))
    #: E2B volumes (:mod:`forkyard.orchestrator.volumes`): how many a node keeps and each one's size
    #: (MiB; an ext4 image, so writes beyond it fail with ENOSPC, inside sandboxes too).
    max_volumes: int = field(default_factory=lambda: int(os.environ.get("FORKYARD_MAX_VOLUMES", "64")))
    volume_size_mb: int = field(default_factory=lambda: int(os.environ.get("FORKYARD_VOLUME_SIZE_MB", "1024")))
    volumes_root_override: Path | None = field(
        default_factory=lambda: Path(os.environ["FORKYARD_VOLUMES_DIR"]) if os.environ.get("FORKYARD_VOLUMES_DIR")
        else None)
    volume_idle_s: float = field(default_factory=lambda: float(os.environ.get("FORKYARD_VOLUME_IDLE_S", "30")))
    volume_lease_wait_s: float = field(
        default_factory=lambda: float(os.environ.get("FORKYARD_VOLUME_LEASE_WAIT_S", "15")))
    #: ``FORKYARD_API_KEY``: the API key, when given in the environment (else the node
    #: keeps one in :attr:`api_key_file`).
    api_key: str | None = field(default_factory=lambda: api_key_from_env(), repr=False)

    @property
    def public_domain(self) -> str:
        """The ``domain`` sandbox answers carry: ``FORKYARD_DOMAIN``, else ``localhost:PORT``."""
        return self.domain or f"localhost:{self.port}"

    @property
    def volumes_dir(self) -> Path:
        """Where this node mounts E2B volumes (``<data_dir>/volumes/<id>/data``), 0700."""
        return self.data_dir / "volumes"

    @property
    def volumes_root(self) -> Path:
        """The volumes' images and rows (:attr:`volumes_root_override`, else
        :attr:`volumes_dir`): shared by every node of a cluster."""
        return self.volumes_root_override or self.volumes_dir

    @property
    def db_path(self) -> Path:
        """SQLite state database."""
        return self.data_dir / "state.db"

    templates_override: str | None = field(default_factory=lambda: os.environ.get("FORKYARD_TEMPLATES_DIR"))

    @property
    def templates_dir(self) -> Path:
        """``<templates>/<name>/rootfs`` holds each built template's read-only rootfs;
        ``<data>/templates`` unless ``FORKYARD_TEMPLATES_DIR`` is set."""
        if self.templates_override:
            return Path(self.templates_override).expanduser().resolve()
        return self.data_dir / "templates"

    @property
    def sandboxes_dir(self) -> Path:
        """Per-sandbox working directories (OCI bundle, logs)."""
        return self.data_dir / "sandboxes"

    @property
    def runsc_root(self) -> Path:
        """runsc ``--root`` state directory, private to forkyard."""
        return self.data_dir / "runsc"

    @property
    def api_key_file(self) -> Path:
        """0600 file holding the API key: ``FORKYARD_API_KEY_FILE`` (a cluster shares
        one key), else ``<data>/api_key``, generated on first start."""
        override = os.environ.get("FORKYARD_API_KEY_FILE")
        return Path(override).expanduser().resolve() if override else self.data_dir / "api_key"


@dataclass(frozen=True)
class AdmissionSettings:
    """What this host admits (:class:`forkyard.orchestrator.admission.Capacity` turns these
    into limits; its module doc says how each is used).

    Attributes:
        reserved_memory_mb: ``FORKYARD_RESERVED_MEMORY_MB`` (1024): host memory kept out
            of admission (MiB).
        memory_overcommit: ``FORKYARD_MEMORY_OVERCOMMIT`` (1.0): admitted memory over
            host memory (ratio > 0).
        cpu_overcommit: ``FORKYARD_CPU_OVERCOMMIT`` (unset: vCPUs are not limited): vCPUs
            admitted per host core.
        max_sandboxes: ``FORKYARD_MAX_SANDBOXES`` (unset: 125 per core; 0: no limit).
        min_available_memory_pct: ``FORKYARD_MIN_AVAILABLE_MEMORY_PCT`` (10): below this
            much available host memory nothing new starts (%).
        sandbox_host_mb: ``FORKYARD_SANDBOX_HOST_MB`` (64): host memory a sandbox is
            counted at least (MiB).
    """

    reserved_memory_mb: int = field(default_factory=lambda: int(_env("FORKYARD_RESERVED_MEMORY_MB", "1024")))
    memory_overcommit: float = field(default_factory=lambda: float(_env("FORKYARD_MEMORY_OVERCOMMIT", "1.0")))
    cpu_overcommit: float | None = field(
        default_factory=lambda: float(v) if (v := _env("FORKYARD_CPU_OVERCOMMIT")) else None)
    max_sandboxes: int | None = field(
        default_factory=lambda: int(v) if (v := _env("FORKYARD_MAX_SANDBOXES")) else None)
    min_available_memory_pct: float = field(
        default_factory=lambda: float(_env("FORKYARD_MIN_AVAILABLE_MEMORY_PCT", "10")))
    sandbox_host_mb: int = field(default_factory=lambda: int(_env("FORKYARD_SANDBOX_HOST_MB", "64")))


def api_key_from_env() -> str | None:
    """``FORKYARD_API_KEY`` as given, None when unset or empty (the node then keeps its
    key in :attr:`Settings.api_key_file`)."""
    return os.environ.get("FORKYARD_API_KEY") or None


def hold_dir() -> Path | None:
    """``FORKYARD_TEST_HOLD_DIR``: where tests arm the orchestrator's hold points
    (:mod:`forkyard.orchestrator.holds`); None (the default) turns them off. Read at each
    call, so a test can arm a server it started with the variable set."""
    d = os.environ.get("FORKYARD_TEST_HOLD_DIR")
    return Path(d) if d else None


#: :attr:`GVisorSettings.share_restored_pages`: which restores share the image's pages.
SHARE_OFF, SHARE_FORKS, SHARE_ALL = "off", "forks", "all"


@dataclass(frozen=True)
class GVisorSettings:
    """Tunables of the gVisor driver (:class:`forkyard.runtime.gvisor.GVisorDriver`); the
    binary and its state directory are the node's (:attr:`Settings.runsc`,
    :attr:`Settings.runsc_root`).

    Attributes:
        spare_disks: ``FORKYARD_SPARE_DISKS`` (16): per-sandbox disks of the node's default
            size kept made ahead of demand (as many as a fork restores at once,
            ``FORKYARD_FORK_PARALLELISM``: fork ×16 measured 1.07x of raw with 16 spares,
            1.13-1.22x with 4); ~2 MB of host disk, one loop device and one mount each.
        envd_rearm: ``FORKYARD_ENVD_REARM=1``: nudge every restored envd with SIGUSR1
            (``runsc kill``, ~9-20 ms per restore) so it re-registers its listener. Off
            by default: the epoll bug it works around (gVisor issue 13920) is fixed in the
            pinned build (gVisor PR 14147), and envd's accept poll still bounds a missed
            wake-up to 1 s (docs/runtime.md).
        runsc_debug: ``FORKYARD_RUNSC_DEBUG=1``: runsc logs debug output under
            ``<data>/runsc-debug/``.
        reaper_daemon: ``FORKYARD_REAPER_DAEMON`` (on; ``0`` turns it off): sandboxes start
            under the node's reaper daemon, which reaps them at once also after a server
            restart (docs/runtime.md).
        share_restored_pages: ``FORKYARD_SHARE_RESTORED_PAGES``: which restored
            sandboxes map their memory copy-on-write from the checkpoint's pages file
            instead of copying it (runsc ``--share-restored-pages``, forkyard's runsc
            patch 0020), so sandboxes restored from one image share the host's page
            cache of it: ``forks`` (the default) only the children of a fork — one
            source's checkpoint, one owner; ``all`` (also ``1``) every restore, resumes
            and creates from templates and snapshots too; ``off`` (also ``0``) none.
            Used only when the runsc build has the flag (a node whose build lacks it
            logs a warning and copies). Not ``all`` by default because sandboxes of
            different owners restored from one image (a template's, a snapshot used by
            several) would then share physical pages (a timing side channel), and an
            unlinked image's disk space stays held while a sandbox maps it
            (docs/runtime.md "Memory"). E2B has no such setting: its VMs restore from
            snapshots memory-mapped by Firecracker, shared alike.
        share_saved_pages: ``FORKYARD_SHARE_SAVED_PAGES`` (on; ``0`` turns it off): a
            sandbox that keeps running after a checkpoint (fork, snapshot) then maps its
            unchanged memory from the image it just wrote (``runsc checkpoint
            --share-saved-pages``, same patch), so a fork source and its children share
            one copy; needs ``share_restored_pages`` and uncompressed images, and with
            ``forks`` applies to a fork's checkpoint only.
    """

    spare_disks: int = field(default_factory=lambda: int(_env("FORKYARD_SPARE_DISKS", "16")))
    envd_rearm: bool = field(default_factory=lambda: _env("FORKYARD_ENVD_REARM", "0") == "1")
    runsc_debug: bool = field(default_factory=lambda: _env("FORKYARD_RUNSC_DEBUG") == "1")
    reaper_daemon: bool = field(default_factory=lambda: _env("FORKYARD_REAPER_DAEMON", "1") != "0")
    share_restored_pages: str = field(default_factory=lambda: _env_choice(
        "FORKYARD_SHARE_RESTORED_PAGES", SHARE_FORKS,
        {"forks": SHARE_FORKS, "all": SHARE_ALL, "1": SHARE_ALL, "off": SHARE_OFF, "0": SHARE_OFF}))
    share_saved_pages: bool = field(default_factory=lambda: _env("FORKYARD_SHARE_SAVED_PAGES", "1") != "0")


#: Default upstreams of the package cache (its allowlist): PyPI's simple index, the npm
#: registry, and the Debian hosts apt may fetch from (main archive and security).
DEFAULT_PYPI_INDEX = "https://pypi.org/simple/"
DEFAULT_NPM_REGISTRY = "https://registry.npmjs.org"
DEFAULT_APT_HOSTS = ("deb.debian.org", "security.debian.org")


@dataclass(frozen=True)
class PackageCacheSettings:
    """The node's package cache for sandboxes (:mod:`forkyard.pkgcache`; beyond E2B, off
    by default).

    Attributes:
        enabled: ``FORKYARD_PACKAGE_CACHE`` (``off``; ``on``): the node runs the cache
            services and configures ``pip``, ``npm`` and ``apt`` in every sandbox it
            creates (template builds included) to fetch through them.
        address: ``FORKYARD_PACKAGE_CACHE_ADDR`` (``169.254.77.1``): the IPv4 address the
            services listen on, put on a dummy interface of the host; sandboxes reach it
            through their slot (the same address on every node, so a paused sandbox
            resumes anywhere). Two nodes on one host need different addresses.
        size_mb: ``FORKYARD_PACKAGE_CACHE_MB`` (10240): the most disk the cached files
            take (MiB), half for Python packages, half for npm and apt; the least used
            go first.
        user: ``FORKYARD_PACKAGE_CACHE_USER`` (``forkyard-cache``): the unprivileged
            account the services run as (``deploy/install.sh`` creates it).
        squid: ``FORKYARD_SQUID`` (``/usr/sbin/squid``): the squid binary (npm and apt).
        pypi_index: ``FORKYARD_PACKAGE_CACHE_PYPI`` (:data:`DEFAULT_PYPI_INDEX`): the one
            Python package index fetched from.
        npm_registry: ``FORKYARD_PACKAGE_CACHE_NPM`` (:data:`DEFAULT_NPM_REGISTRY`): the
            one npm registry fetched from (``https://HOST[:PORT]``).
        apt_hosts: ``FORKYARD_PACKAGE_CACHE_APT_HOSTS`` (comma-separated,
            :data:`DEFAULT_APT_HOSTS`): the hosts apt may fetch from over HTTP.
        host_proxy: the node's own ``http_proxy``/``https_proxy``/``no_proxy`` (any
            case), passed to the services: a host that reaches the registries through a
            proxy of its own.
    """

    enabled: bool = field(default_factory=lambda: _env_on("FORKYARD_PACKAGE_CACHE"))
    address: str = field(default_factory=lambda: _env("FORKYARD_PACKAGE_CACHE_ADDR", "169.254.77.1"))
    size_mb: int = field(default_factory=lambda: int(_env("FORKYARD_PACKAGE_CACHE_MB", "10240")))
    user: str = field(default_factory=lambda: _env("FORKYARD_PACKAGE_CACHE_USER", "forkyard-cache"))
    squid: str = field(default_factory=lambda: _env("FORKYARD_SQUID", "/usr/sbin/squid"))
    pypi_index: str = field(default_factory=lambda: _env("FORKYARD_PACKAGE_CACHE_PYPI", DEFAULT_PYPI_INDEX))
    npm_registry: str = field(default_factory=lambda: _env("FORKYARD_PACKAGE_CACHE_NPM", DEFAULT_NPM_REGISTRY))
    apt_hosts: tuple[str, ...] = field(default_factory=lambda: tuple(
        h.strip().lower() for h in _env("FORKYARD_PACKAGE_CACHE_APT_HOSTS", ",".join(DEFAULT_APT_HOSTS)).split(",")
        if h.strip()))
    host_proxy: dict[str, str] = field(default_factory=lambda: {
        k: v for k, v in os.environ.items() if k.lower() in ("http_proxy", "https_proxy", "no_proxy")}, repr=False)
