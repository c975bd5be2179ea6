"""The smoke flow against a cluster gateway with the official e2b SDK, on every node:
create sandboxes until each node holds one (placement spreads them), then in each run a
command, start a process and write a file, pause it, resume it (the process and the
file are still there), fork it (the child has the file), kill both.

Reads E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY from the environment; the argument is
the number of nodes. Exits non-zero (an exception) when any step fails; prints one line
per step with its time in seconds.
"""

from __future__ import annotations

import os
import sys
import time

import httpx
from e2b import Sandbox


def nodes_of(ids: set[str]) -> dict[str, str]:
    """``{sandbox id: node id}`` from the gateway's listing (its ``nodeID`` field)."""
    r = httpx.get(f"{os.environ['E2B_API_URL']}/v2/sandboxes", params={"limit": 100},
                  headers={"X-API-Key": os.environ["E2B_API_KEY"]}, timeout=30)
    r.raise_for_status()
    return {x["sandboxID"]: x.get("nodeID") for x in r.json() if x["sandboxID"] in ids}


def step(what: str, fn):
    t = time.monotonic()
    out = fn()
    print(f"{what}: {time.monotonic() - t:.2f} s", flush=True)
    return out


def main(count: int = 3) -> None:
    t0 = time.monotonic()
    boxes: dict[str, Sandbox] = {}
    extra: list[Sandbox] = []
    try:
        by_node: dict[str, Sandbox] = {}
        for _ in range(count * 3):
            sbx = step("create", lambda: Sandbox.create("base", timeout=300, metadata={"smoke": "1"}))
            node = nodes_of({sbx.sandbox_id})[sbx.sandbox_id]
            if node in by_node:
                extra.append(sbx)
            else:
                by_node[node] = boxes[sbx.sandbox_id] = sbx
            if len(by_node) == count:
                break
        assert len(by_node) == count, f"sandboxes landed on {sorted(by_node)} only, not on {count} nodes"
        for node, sbx in sorted(by_node.items()):
            sid = sbx.sandbox_id
            r = step(f"[{node}] commands.run", lambda: sbx.commands.run("python3 -c 'print(6*7)'; hostname"))
            assert r.exit_code == 0 and r.stdout.split()[0] == "42", r
            sbx.files.write("/home/user/smoke.txt", f"written on {node}")
            bg = sbx.commands.run("sleep 3600", background=True, timeout=0)
            step(f"[{node}] pause", sbx.pause)
            back = step(f"[{node}] resume (connect)", lambda: Sandbox.connect(sid))
            assert back.files.read("/home/user/smoke.txt") == f"written on {node}"
            assert bg.pid in [p.pid for p in back.commands.list()], "the process did not survive pause/resume"
            resumed_on = nodes_of({sid})[sid]
            r = step(f"[{node}] fork", lambda: httpx.post(f"{os.environ['E2B_API_URL']}/sandboxes/{sid}/fork",
                                                        json={"count": 1, "timeout": 120},
                                                        headers={"X-API-Key": os.environ["E2B_API_KEY"]}, timeout=300))
            assert r.status_code == 201 and "sandbox" in r.json()[0], r.text
            child = Sandbox.connect(r.json()[0]["sandbox"]["sandboxID"])
            extra.append(child)
            assert child.files.read("/home/user/smoke.txt") == f"written on {node}"
            print(f"[{node}] resumed on {resumed_on}, child on {nodes_of({child.sandbox_id})[child.sandbox_id]}",
                  flush=True)
        listed = {s.sandbox_id for s in Sandbox.list(query=None).next_items()}
        missing = set(boxes) - listed
        assert not missing, f"not listed by the gateway: {missing}"
        print(f"list: {len(listed)} sandboxes", flush=True)
    finally:
        for sbx in list(boxes.values()) + extra:
            try:
                sbx.kill()
            except Exception as e:  # noqa: BLE001 — report, go on with the others
                print(f"kill {sbx.sandbox_id} failed: {e}", flush=True)
    print(f"smoke flow ok on {count} nodes in {time.monotonic() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
