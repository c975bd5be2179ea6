"""What a template build may be asked: names and tags, the base it starts from, the
steps (E2B's ``TemplateBuildStartV2``), and the record of a build (status and logs, E2B's
``TemplateBuildInfo`` shapes).
"""

from __future__ import annotations

import posixpath
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from forkyard.config import Settings
from forkyard.guest import envd
from forkyard.ids import is_name, rfc3339
from forkyard.orchestrator import images
from forkyard.orchestrator.errors import BadRequest
from forkyard.templates import registry, tags

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_USER = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]{0,31}(:[A-Za-z0-9_.][A-Za-z0-9_.-]{0,31})?$")
_MODE = re.compile(r"^[0-7]{3,4}$")
STEP_TYPES = {"RUN", "COPY", "ENV", "WORKDIR", "USER"}
#: Image names that mean our ``base`` template (E2B's default ``fromImage``).
BASE_IMAGES = {"e2bdev/base"}  # as Docker Hub repositories
MAX_LOG_ENTRIES = 20000
#: Characters of log messages one build keeps (the oldest go first), so a step that
#: prints without end holds at most this much server memory.
MAX_LOG_BYTES = 16 << 20


def split_name(name: str) -> tuple[str, str | None]:
    """``"name:tag"`` → ``("name", "tag")`` (the tag normalized as E2B does:
    :func:`forkyard.templates.tags.normalize`); validates both.

    Raises:
        BadRequest: invalid name or tag.
    """
    if not isinstance(name, str):
        raise BadRequest("template name must be a string")
    base, _, tag = name.strip().partition(":")
    base = base.lower()
    if not is_name(base):
        raise BadRequest(f"invalid template name {base!r}: 1-64 of a-z, 0-9, '-', '_', starting with a letter or digit")
    return base, (tags.normalize([tag])[0] if tag else None)


@dataclass
class BuildRecord:
    """One build of a template: status, resources and log entries (E2B's shapes)."""

    build_id: str
    template_id: str
    status: str  # waiting | building | ready | error
    created_at: float
    cpu_count: int
    memory_mb: int
    finished_at: float | None = None
    #: disk size (MiB) of the template's sandboxes; 0 = the node's FORKYARD_DISK_MB.
    disk_mb: int = 0
    snapshot_id: str | None = None
    reason: dict | None = None
    #: tags the build gets when it succeeds (none asked: ``default``)
    tags: list[str] = field(default_factory=list)
    logs: list[dict] = field(default_factory=list)

    def log(self, message: str, level: str = "info", step: str | None = None) -> None:
        """Append a log entry (oldest entries are dropped past :data:`MAX_LOG_ENTRIES`
        entries or :data:`MAX_LOG_BYTES` of messages; a message is cut at
        :data:`forkyard.guest.envd.MAX_LINE_BYTES` characters)."""
        if len(message) > envd.MAX_LINE_BYTES:
            message = message[: envd.MAX_LINE_BYTES]
        entry = {"timestamp": rfc3339(time.time()), "level": level, "message": message}
        if step is not None:
            entry["step"] = step
        self.logs.append(entry)
        size = self.__dict__.get("_log_bytes")
        if size is None:
            size = sum(len(e.get("message", "")) for e in self.logs[:-1])
        size += len(message)
        if len(self.logs) > MAX_LOG_ENTRIES or size > MAX_LOG_BYTES:
            drop = 0
            while drop < len(self.logs) - 1 and (len(self.logs) - drop > MAX_LOG_ENTRIES or size > MAX_LOG_BYTES):
                size -= len(self.logs[drop].get("message", ""))
                drop += 1
            del self.logs[:drop]
        self.__dict__["_log_bytes"] = size  # not a field: never saved


class StepFailed(Exception):
    """A build step failed; ``step`` is E2B's step name (``base``, ``1``…, ``finalize``)."""

    def __init__(self, step: str, message: str):
        super().__init__(message)
        self.step = step


@dataclass(frozen=True)
class PullBase:
    """A build's base that is pulled from a registry first: ``image`` (the reference
    as given) with ``creds`` (None: anonymous)."""

    image: str
    creds: registry.Credentials | None = None


def registry_credentials(cfg) -> registry.Credentials | None:
    """E2B's ``fromImageRegistry`` (``{"type": "registry", "username", "password"}``) as
    credentials; None when absent.

    Raises:
        BadRequest: malformed, or a type forkyard does not pull with (``aws``, ``gcp``).
    """
    if cfg is None:
        return None
    if not isinstance(cfg, dict):
        raise BadRequest("fromImageRegistry must be an object")
    typ = cfg.get("type")
    if typ in ("aws", "gcp"):
        raise BadRequest(f"fromImageRegistry of type {typ!r} is not supported here: use from_image(image, "
                         "username=, password=) (ECR: username 'AWS', password from `aws ecr get-login-password`; "
                         "GCP: username '_json_key', password the service account JSON)")
    user, password = cfg.get("username"), cfg.get("password")
    if typ != "registry" or not isinstance(user, str) or not isinstance(password, str) or not user or not password:
        raise BadRequest("fromImageRegistry must be {\"type\": \"registry\", \"username\": ..., \"password\": ...}")
    if len(user) > 1024 or len(password) > 16384:
        raise BadRequest("fromImageRegistry username or password is too long")
    return registry.Credentials(user, password)


def resolve_base(settings: Settings, snapshots, body: dict) -> str | PullBase:
    """The template a build starts from (E2B ``fromTemplate``/``fromImage``; default
    ``base``): a rootfs template built here or a snapshot in ``snapshots``
    (``find(name)``), or an image to pull from its registry first (:class:`PullBase`,
    with ``fromImageRegistry``'s credentials). E2B's base image (``e2bdev/base``, what
    ``from_base_image()`` names) means the local ``base``.

    Raises:
        BadRequest: both given, a malformed value or image reference, credentials
            without an image, or no template of that name here.
    """
    tmpl = body.get("fromTemplate")
    image = body.get("fromImage")
    creds = registry_credentials(body.get("fromImageRegistry"))
    if tmpl is not None and image is not None:
        raise BadRequest("give fromTemplate or fromImage, not both")
    if creds is not None and image is None:
        raise BadRequest("fromImageRegistry needs fromImage")
    if tmpl is not None:
        if not isinstance(tmpl, str):
            raise BadRequest("fromTemplate must be a string")
        name = tmpl.partition(":")[0]
        if images.resolve(settings, name) or snapshots.find(name):
            return name
        raise BadRequest(f"base template {tmpl!r} not found")
    if image is None:
        return "base"
    if not isinstance(image, str) or not image:
        raise BadRequest("fromImage must be a non-empty string")
    try:
        ref = registry.parse_reference(image)
    except registry.PullError as e:
        raise BadRequest(str(e)) from None
    if ref.registry == registry.DOCKER_HUB and ref.repository in BASE_IMAGES and not ref.digest:
        return "base"
    return PullBase(image, creds)


def validate_steps(steps, file_path: Callable[[str], Path]) -> list[dict]:
    """The build's steps (E2B ``TemplateStep``: ``{"type", "args", "filesHash"}``)
    checked: supported types, their arguments, users and modes, COPY sources inside the
    build context and uploaded (``file_path(files_hash)`` names the stored tarball).
    Returns them as ``{"type", "args", "filesHash"}`` dicts.

    Raises:
        BadRequest: the first problem found, naming the step.
    """
    if steps is None:
        return []
    if not isinstance(steps, list):
        raise BadRequest("steps must be a list")
    out = []
    for i, s in enumerate(steps, 1):
        if not isinstance(s, dict):
            raise BadRequest(f"step {i} must be an object")
        typ, args = s.get("type"), s.get("args") or []
        if typ not in STEP_TYPES:
            raise BadRequest(f"step {i}: unsupported type {typ!r} (supported: {', '.join(sorted(STEP_TYPES))})")
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise BadRequest(f"step {i}: args must be a list of strings")
        if typ == "RUN" and (not 1 <= len(args) <= 2 or not args[0].strip()):
            raise BadRequest(f"step {i}: RUN needs a command and an optional user")
        if typ in ("RUN",) and len(args) == 2 and args[1] and not _USER.match(args[1]):
            raise BadRequest(f"step {i}: invalid user {args[1]!r}")
        if typ == "ENV" and (len(args) % 2 or not args or not all(_ENV_NAME.match(k) for k in args[::2])):
            raise BadRequest(f"step {i}: ENV needs name/value pairs with valid names")
        if typ in ("WORKDIR", "USER") and (len(args) != 1 or not args[0]):
            raise BadRequest(f"step {i}: {typ} needs exactly one argument")
        if typ == "USER" and not _USER.match(args[0]):
            raise BadRequest(f"step {i}: invalid user {args[0]!r}")
        if typ == "COPY":
            if not 2 <= len(args) <= 4 or not args[0] or not args[1]:
                raise BadRequest(f"step {i}: COPY needs src, dest, [user, mode]")
            if len(args) > 2 and args[2] and not _USER.match(args[2]):
                raise BadRequest(f"step {i}: invalid COPY user {args[2]!r}")
            if len(args) > 3 and args[3] and not _MODE.match(args[3]):
                raise BadRequest(f"step {i}: invalid COPY mode {args[3]!r}")
            src = posixpath.normpath(args[0])
            if src.startswith(("/", "../")) or src == "..":
                raise BadRequest(f"step {i}: COPY source must be relative to the build context")
            path = file_path(s.get("filesHash") or "")
            if not path.exists():
                raise BadRequest(f"step {i}: files of COPY {args[0]!r} were not uploaded (filesHash {s.get('filesHash')})")
        out.append({"type": typ, "args": list(args), "filesHash": s.get("filesHash")})
    return out
