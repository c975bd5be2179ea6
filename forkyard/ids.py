"""Ids and names as forkyard makes and accepts them, and the RFC 3339 time text of its
answers: one definition each, for every layer (this module imports nothing of forkyard).

* **Sandbox id**: 1-64 of ``a-z0-9``; forkyard makes 20 (:func:`new_sandbox_id`, the
  shape of E2B's ids). It names host paths (a sandbox's work directory), so nothing else
  may pass for one.
* **Name**: a template, a snapshot (its id and its names), an image: ``a-z0-9`` first,
  then ``a-z0-9``, ``_`` and ``-``, 64 at most (E2B's template names are the same
  alphabet). Snapshot ids forkyard makes are 20 of ``a-z0-9`` (:func:`new_snapshot_id`).

The checks match whole strings (``fullmatch``): a trailing newline is not a name.
"""

from __future__ import annotations

import re
import secrets
import string
from datetime import datetime, timedelta, timezone

#: The UNIX epoch, aware (UTC).
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)

#: Regex text of a sandbox id, without anchors, to build bigger patterns from.
SANDBOX_ID = r"[a-z0-9]{1,64}"
#: Regex text of a name (template, snapshot, image), without anchors.
NAME = r"[a-z0-9][a-z0-9_-]{0,63}"

_SANDBOX_ID_RE = re.compile(SANDBOX_ID)
_NAME_RE = re.compile(NAME)
_ALPHABET = string.ascii_lowercase + string.digits


def is_sandbox_id(value: object) -> bool:
    """True when ``value`` is a string that is a whole sandbox id (:data:`SANDBOX_ID`)."""
    return isinstance(value, str) and _SANDBOX_ID_RE.fullmatch(value) is not None


def is_name(value: object) -> bool:
    """True when ``value`` is a string that is a whole name (:data:`NAME`)."""
    return isinstance(value, str) and _NAME_RE.fullmatch(value) is not None


def new_sandbox_id() -> str:
    """A new 20-character lower-case alphanumeric sandbox id (the shape E2B uses)."""
    return "".join(secrets.choice(_ALPHABET) for _ in range(20))


def new_snapshot_id() -> str:
    """A new 20-character lower-case alphanumeric snapshot id (also a :data:`NAME`)."""
    return "".join(secrets.choice(_ALPHABET) for _ in range(20))


def new_volume_id() -> str:
    """A new 20-character lower-case alphanumeric E2B volume id (also a :data:`NAME`)."""
    return "".join(secrets.choice(_ALPHABET) for _ in range(20))


def micros(ts: float) -> int:
    """UNIX time ``ts`` (seconds) in whole microseconds, exactly as :func:`rfc3339` shows
    it (Python rounds to the nearest microsecond, so the text can lie up to 0.5 µs
    *after* ``ts``): compare times a client sent back from our own text in these units,
    never as floats, or a sandbox's own ``startedAt`` fails ``startedAfter`` (it did
    for 38 % of random start times)."""
    return micros_of(datetime.fromtimestamp(ts, timezone.utc))


def micros_of(t: datetime) -> int:
    """Whole microseconds since the UNIX epoch of the aware datetime ``t`` (no float on
    the way)."""
    return (t - EPOCH) // timedelta(microseconds=1)


def rfc3339(ts: float, timespec: str = "auto") -> str:
    """UNIX time ``ts`` (seconds) as RFC 3339 text in UTC with a ``Z``:
    ``2026-12-01T20:14:03.250000Z``. ``timespec`` is :meth:`datetime.isoformat`'s
    (``auto``: microseconds unless they are 0; ``milliseconds``; ``seconds``: the
    fraction cut off, not rounded)."""
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec=timespec).replace("+00:00", "Z")
