"""TCP across pause/resume: a listener that was busy right before a pause accepts every
new connection after the resume (regression for restored TIME-WAIT endpoints dropping
SYNs for up to 60 s; docs/runtime.md, deploy/runsc/patches/0001)."""

from __future__ import annotations

import json

from e2b import Sandbox

# Short HTTP/1.0 requests to the sandbox's own listener: the server closes first, so each
# one leaves a TIME-WAIT endpoint on the listener's side. ``first`` > 0 binds the client
# to ports first..first+n-1 (the same 4-tuples again after the resume), 0 lets the stack
# pick ephemeral ports. A connect that does not finish within 3 s counts as hung.
# The bound ports lie below gVisor's ephemeral range (16000-65535, pkg/tcpip/ports) and
# Linux's (32768-60999): inside it, a port the stack gave another socket (envd's, the
# readiness probe's in TIME-WAIT) fails the bind with EADDRINUSE (CI, stop 28).
HAMMER = r"""
import json, socket, sys, time
first, n = int(sys.argv[1]), int(sys.argv[2])
hung, worst = [], 0.0
for i in range(n):
    t = time.monotonic()
    s = socket.socket()
    s.settimeout(3)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        if first:
            s.bind(("127.0.0.1", first + i))
        s.connect(("127.0.0.1", 8000))
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        while s.recv(65536):
            pass
    except OSError as e:
        hung.append([first + i if first else i, repr(e)])
        if len(hung) >= 3:
            break
    finally:
        s.close()
    worst = max(worst, time.monotonic() - t)
print(json.dumps({"hung": hung, "worst_s": round(worst, 3)}))
"""

FIRST_PORT = 10000

SERVER = ("cd /tmp && exec python3 -c 'import http.server as h; "
          "h.ThreadingHTTPServer((\"127.0.0.1\", 8000), h.SimpleHTTPRequestHandler).serve_forever()'")


def hammer(sbx: Sandbox, first: int, n: int) -> dict:
    return json.loads(sbx.commands.run(f"python3 /tmp/hammer.py {first} {n}", timeout=300).stdout)


def test_busy_listener_accepts_every_connection_after_resume(sandbox):
    sandbox.files.write("/tmp/hammer.py", HAMMER)
    sandbox.commands.run(SERVER, background=True, timeout=0)
    sandbox.commands.run("for i in $(seq 50); do python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 8000))' "
                         "2>/dev/null && exit 0; sleep 0.1; done; exit 1")
    before = hammer(sandbox, FIRST_PORT, 1000)
    assert before["hung"] == [], before
    sandbox.pause()
    resumed = Sandbox.connect(sandbox.sandbox_id)
    # The same 4-tuples the listener holds in TIME-WAIT from before the pause ...
    same = hammer(resumed, FIRST_PORT, 1000)
    assert same["hung"] == [], f"connects hung after resume on tuples in TIME-WAIT at the pause: {same}"
    # ... and 1200 on ports the stack picks.
    fresh = hammer(resumed, 0, 1200)
    assert fresh["hung"] == [], fresh
