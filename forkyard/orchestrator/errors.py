"""Orchestrator errors, each mapped by the API to an HTTP status (E2B's codes)."""


class OrchestratorError(Exception):
    """Base error; ``status`` is the HTTP status the API answers with."""

    status = 500


class NotFound(OrchestratorError):
    """Unknown sandbox or template id (404)."""

    status = 404


class BadRequest(OrchestratorError):
    """Invalid argument (400)."""

    status = 400


class Conflict(OrchestratorError):
    """Operation not valid in the sandbox's current state (409)."""

    status = 409


class CreateFailed(OrchestratorError):
    """The runtime or envd failed while creating a sandbox (500); the message carries
    the cause and everything half-created has been removed."""

    status = 500


class Unavailable(OrchestratorError):
    """The sandbox cannot do this right now, e.g. its envd does not answer (503)."""

    status = 503
