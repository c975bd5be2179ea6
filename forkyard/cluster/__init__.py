"""The cluster control plane above the nodes (issue 8).

* :mod:`.scheduler` — ``forkyard scheduler`` (:9090): node registry, placement, sandbox →
  node bindings; all state in Redis (:mod:`.store`).
* :mod:`.gateway` — ``forkyard gateway`` (:8080): the one public E2B-compatible endpoint;
  routes REST calls and sandbox traffic to the owning node.
* :mod:`.agent` — the node's side: heartbeats, mirrors its sandboxes, drains.
* :mod:`.placement` — filter → score → pick, documented in ``docs/architecture.md``.

Nothing here is imported by the node's ``api``/``orchestrator`` packages: the node app
is built as before and the agent attaches to it.
"""
