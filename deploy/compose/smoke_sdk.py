"""The smoke flow against a cluster gateway with the official e2b SDK: create sandboxes
(one per node, so placement spreads them), run a command in each, list, kill.

Reads E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY from the environment. Exits non-zero
(an exception) when any step fails; prints one line per step with its time in seconds.
"""

from __future__ import annotations

import sys
import time

from e2b import Sandbox


def main(count: int = 3) -> None:
    t0 = time.monotonic()
    boxes: list[Sandbox] = []
    try:
        for i in range(count):
            t = time.monotonic()
            boxes.append(Sandbox.create("base", timeout=120, metadata={"smoke": str(i)}))
            print(f"create {boxes[-1].sandbox_id}: {time.monotonic() - t:.2f} s", flush=True)
        for i, sbx in enumerate(boxes):
            t = time.monotonic()
            r = sbx.commands.run(f"python3 -c 'print(6*{i + 1})'; hostname")
            assert r.exit_code == 0 and r.stdout.split()[0] == str(6 * (i + 1)), r
            print(f"commands.run in {sbx.sandbox_id}: {time.monotonic() - t:.2f} s", flush=True)
        listed = {s.sandbox_id for s in Sandbox.list(query=None).next_items()}
        missing = {s.sandbox_id for s in boxes} - listed
        assert not missing, f"not listed by the gateway: {missing}"
        print(f"list: {len(listed)} sandboxes", flush=True)
    finally:
        for sbx in boxes:
            t = time.monotonic()
            sbx.kill()
            print(f"kill {sbx.sandbox_id}: {time.monotonic() - t:.2f} s", flush=True)
    print(f"smoke flow ok in {time.monotonic() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
