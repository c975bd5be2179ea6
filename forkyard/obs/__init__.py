"""Observability: Prometheus metrics (:mod:`.metrics`), request ids and structured logs
(:mod:`.logs`), the ASGI middleware that ties them to every component (:mod:`.middleware`)
and the web console (:mod:`.console`)."""
