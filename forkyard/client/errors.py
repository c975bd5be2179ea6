"""Errors raised by :mod:`forkyard.client` (and turned into messages by the CLI), and
:class:`ForkError`, the value a fork returns in place of a child that did not start."""

from __future__ import annotations

from dataclasses import dataclass


class ForkyardError(Exception):
    """Base class of every client error. ``hint`` says what to do about it (may be empty)."""

    hint: str = ""

    def __init__(self, message: str, hint: str = "", status: int | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint or self.hint
        #: HTTP status of the failed request, when there was one.
        self.status = status

    def __str__(self) -> str:
        return self.message


class ServerUnreachable(ForkyardError):
    """No connection to the server (refused, DNS failure, timeout while connecting)."""

    def __init__(self, url: str, cause: str = ""):
        super().__init__(f"cannot reach server at {url}" + (f" ({cause})" if cause else ""),
                         hint="start it with ./deploy/up.sh, or point the CLI elsewhere with "
                              "`forkyard auth` / FORKYARD_URL")
        self.url = url


class AuthError(ForkyardError):
    """The server rejected the API key (401/403)."""

    hint = "set the key with `forkyard auth` or E2B_API_KEY (the server prints where its key lives)"


class NotFound(ForkyardError):
    """The sandbox, snapshot or template does not exist (404)."""


class Conflict(ForkyardError):
    """The request conflicts with the current state, e.g. pausing a paused sandbox (409)."""


class BadRequest(ForkyardError):
    """The server refused the request's arguments (400/422)."""


class NotSupported(ForkyardError):
    """This server does not implement the endpoint (404 on the route itself)."""


class ApiError(ForkyardError):
    """Any other non-success answer from the server (5xx, unexpected codes)."""


@dataclass
class ForkError:
    """Why one requested fork did not start (``status``: HTTP-like code). Returned in a
    fork's list of children, never raised."""

    status: int
    message: str

    def __str__(self) -> str:
        return f"{self.status}: {self.message}"
