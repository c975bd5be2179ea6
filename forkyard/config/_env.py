"""Helpers that read one environment variable each and say which one was wrong
(the ``_env*`` readers every settings class of :mod:`forkyard.config` uses)."""

from __future__ import annotations

import os
from pathlib import Path


def _env_bool(name: str, default: bool) -> bool:
    """``true``/``1``/``yes`` or ``false``/``0``/``no`` (any case) from the environment.

    Raises:
        ValueError: any other value (naming the variable).
    """
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes"):
        return True
    if raw.lower() in ("0", "false", "no"):
        return False
    raise ValueError(f"{name} must be true or false, not {raw!r}")


def _env_cidrs(name: str) -> list[str] | None:
    """Comma-separated IPv4 CIDRs from the environment (None when unset).

    Raises:
        ValueError: an entry is not an IPv4 CIDR (naming the variable).
    """
    import ipaddress

    raw = os.environ.get(name)
    if raw is None:
        return None
    out = []
    for part in (p.strip() for p in raw.split(",")):
        if not part:
            continue
        try:
            out.append(str(ipaddress.IPv4Network(part, strict=False)))
        except ValueError as e:
            raise ValueError(f"{name}: {part!r} is not an IPv4 CIDR") from e
    return out


def _env_path(name: str, default: str) -> Path:
    return Path(os.environ.get(name, default)).expanduser().resolve()


def _env(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def _env_on(name: str) -> bool:
    """``on``/``off`` (also ``1``/``0``, ``true``/``false``, ``yes``/``no``; any case;
    unset or empty: off).

    Raises:
        ValueError: any other value (naming the variable).
    """
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "off", "0", "false", "no"):
        return False
    if raw in ("on", "1", "true", "yes"):
        return True
    raise ValueError(f"{name} must be on or off, not {raw!r}")


def _env_choice(name: str, default: str, choices: dict[str, str]) -> str:
    """One of ``choices``' values, looked up by the variable's value (any case; unset or
    empty: ``default``); ``choices`` maps each accepted spelling to its value.

    Raises:
        ValueError: any other value (naming the variable and what it accepts).
    """
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return choices[raw.lower()]
    except KeyError:
        raise ValueError(f"{name} must be one of {', '.join(sorted(set(choices)))}, not {raw!r}") from None
