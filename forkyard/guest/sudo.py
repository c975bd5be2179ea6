"""``sudo`` for unprivileged users inside gVisor sandboxes.

gVisor does not implement set-user-ID executables: ``prctl(PR_GET_NO_NEW_PRIVS)`` always
returns 1 and exec never raises privileges (see gVisor's
``Task.updateCredsForExecLocked``), and it has no ambient capabilities either (measured
with runsc 20240729: a uid-1000 process keeps no capability across exec). So
``/usr/bin/sudo`` run by ``user`` fails with *"The no new privileges flag is set"*.

The ``base`` template therefore ships a small broker:

* ``/usr/bin/sudo`` is diverted (``dpkg-divert``) to ``/usr/bin/sudo.distrib`` and
  replaced by :data:`SHIM`. Run by root, the shim execs the real sudo (which works for
  root). Run by anyone else, it connects to the broker socket, hands over its argv, cwd,
  environment and stdin/stdout/stderr (``SCM_RIGHTS``), forwards SIGINT/SIGTERM/SIGHUP/
  SIGQUIT, and exits with the command's status.
* :data:`BROKER` (``/usr/local/lib/forkyard/sudo-broker``) runs as root, listens on
  ``/run/forkyard/sudo.sock`` (mode 0660, group ``sudo``) and, for callers in group
  ``sudo`` (uid proven with ``SCM_CREDENTIALS`` — gVisor's ``SO_PEERCRED`` returns the
  listener's own credentials, measured), runs the real sudo as root with the caller's
  fds, cwd and environment.
  Differences from setuid sudo: the command sees ``SUDO_USER=root``, and it has no
  controlling terminal (``sudo -i`` works, without job control).

The broker must be started as root when the sandbox boots — by envd (PID 1), e.g.
``exec.Command("/usr/local/lib/forkyard/sudo-broker").Start()`` if that file exists.
It is part of every checkpoint, so sandboxes restored from a template snapshot have it.
"""

from __future__ import annotations

from pathlib import Path

BROKER_PATH = "/usr/local/lib/forkyard/sudo-broker"
SHIM_PATH = "/usr/bin/sudo"
REAL_SUDO = "/usr/bin/sudo.distrib"
SOCKET_PATH = "/run/forkyard/sudo.sock"

SHIM = r'''#!/usr/bin/python3 -I
# forkyard sudo shim: see /usr/local/lib/forkyard/sudo-broker.
import os
import sys

REAL = "/usr/bin/sudo.distrib"
SOCK = "/run/forkyard/sudo.sock"
BROKER = "/usr/local/lib/forkyard/sudo-broker"

NAME = os.path.basename(sys.argv[0]) or "sudo"  # "sudoedit" selects edit mode
if os.geteuid() != 0 and not os.path.exists(SOCK) and os.path.exists(BROKER):
    # The broker starts with the sandbox, next to envd: a sudo in the sandbox's first
    # moments (a command sent right after create) waits for its socket (at most 5 s).
    import time

    deadline = time.monotonic() + 5
    while not os.path.exists(SOCK) and time.monotonic() < deadline:
        time.sleep(0.02)
if os.geteuid() == 0 or not os.path.exists(SOCK):
    # root: the real sudo works. No broker: let the real sudo explain why it cannot.
    os.execv(REAL, [NAME] + sys.argv[1:])

import array
import json
import signal
import socket
import struct

s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(SOCK)
except PermissionError:
    sys.stderr.write("sudo: you are not allowed to use sudo (not in group sudo)\n")
    sys.exit(1)
except OSError as e:
    sys.stderr.write(f"sudo: cannot reach the sudo broker at {SOCK}: {e}\n")
    sys.exit(1)
try:
    cwd = os.getcwd()
except OSError:
    cwd = "/"
body = json.dumps({"name": NAME, "argv": sys.argv[1:], "cwd": cwd, "env": dict(os.environ)}).encode()
fds = array.array("i", [0, 1, 2])
creds = struct.pack("3i", os.getpid(), os.getuid(), os.getgid())  # verified by the kernel
s.sendmsg(
    [struct.pack(">I", len(body))],
    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds), (socket.SOL_SOCKET, socket.SCM_CREDENTIALS, creds)],
)
s.sendall(body)


def forward(signum, frame):
    try:
        s.send(bytes([signum]))
    except OSError:
        pass


for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
    signal.signal(sig, forward)
data = b""
while len(data) < 4:
    chunk = s.recv(4 - len(data))
    if not chunk:
        sys.stderr.write("sudo: the sudo broker went away\n")
        sys.exit(1)
    data += chunk
sys.exit(struct.unpack(">i", data)[0])
'''

BROKER = r'''#!/usr/bin/python3 -I
"""forkyard sudo broker (root). gVisor ignores set-user-ID bits, so the sudo shim at
/usr/bin/sudo asks this daemon to run the real sudo (/usr/bin/sudo.distrib) as root on
behalf of members of group "sudo". Start it once per sandbox as root; it daemonizes
nothing and logs to stderr."""
import array
import grp
import json
import os
import pwd
import signal
import socket
import struct
import sys
import threading

SOCK = "/run/forkyard/sudo.sock"
REAL = "/usr/bin/sudo.distrib"


def allowed(uid):
    if uid == 0:
        return True
    try:
        user = pwd.getpwuid(uid)
        group = grp.getgrnam("sudo")
    except KeyError:
        return False
    return user.pw_name in group.gr_mem or user.pw_gid == group.gr_gid


def recv_exact(conn, n):
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def handle(conn):
    fds = []
    try:
        # gVisor's SO_PEERCRED reports the listener's own credentials, so the caller
        # proves its uid with SCM_CREDENTIALS (the kernel rejects forged values).
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        uid = None
        ints = array.array("i")
        head, anc, _, _ = conn.recvmsg(4, socket.CMSG_SPACE(3 * ints.itemsize) + socket.CMSG_SPACE(12))
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                ints.frombytes(data[: len(data) - len(data) % ints.itemsize])
            elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                uid = struct.unpack("3i", data[:12])[1]
        fds = list(ints)
        head += recv_exact(conn, 4 - len(head))
        req = json.loads(recv_exact(conn, struct.unpack(">I", head)[0]))
        if len(fds) != 3:
            conn.sendall(struct.pack(">i", 1))
            return
        if uid is None or not allowed(uid):
            os.write(fds[2], b"sudo: you are not allowed to use sudo (not in group sudo)\n")
            conn.sendall(struct.pack(">i", 1))
            return
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                # Commands must not inherit Python's (SIGPIPE, SIGXFSZ ignored) or a
                # launching shell's (SIGINT, SIGQUIT ignored for "&" jobs) dispositions.
                for sig in range(1, signal.NSIG):
                    if sig not in (signal.SIGKILL, signal.SIGSTOP):
                        try:
                            signal.signal(sig, signal.SIG_DFL)
                        except (OSError, ValueError):
                            pass
                signal.pthread_sigmask(signal.SIG_SETMASK, [])
                for i, fd in enumerate(fds):
                    os.dup2(fd, i)
                os.closerange(3, 65536)
                try:
                    os.chdir(req.get("cwd") or "/")
                except OSError:
                    os.chdir("/")
                name = req.get("name") if req.get("name") in ("sudo", "sudoedit") else "sudo"
                os.execve(REAL, [name] + list(req["argv"]), dict(req["env"]))
            finally:
                os._exit(127)
        for fd in fds:
            os.close(fd)
        fds = []

        done = threading.Event()

        def relay():
            while True:
                try:
                    b = conn.recv(1)
                except OSError:
                    b = b""
                if done.is_set():
                    return
                try:
                    # sudo relays signals to the command it runs; shim gone -> SIGHUP.
                    os.kill(pid, b[0] if b else 1)
                except OSError:
                    return
                if not b:
                    return

        threading.Thread(target=relay, daemon=True).start()
        _, status = os.waitpid(pid, 0)
        done.set()
        code = os.waitstatus_to_exitcode(status)
        conn.sendall(struct.pack(">i", code if code >= 0 else 128 - code))
    except Exception as e:  # noqa: BLE001
        print(f"sudo-broker: {e!r}", file=sys.stderr)
    finally:
        for fd in fds:
            os.close(fd)
        conn.close()


def main():
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # a daemon; only SIGTERM/SIGKILL stop it
    os.makedirs(os.path.dirname(SOCK), mode=0o755, exist_ok=True)
    # Bound, restricted and listening under a temporary name, then renamed: the socket
    # appears (the shim waits for it) only when it accepts, and only as it should be.
    tmp = SOCK + ".new"
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    srv.bind(tmp)
    try:  # only root and group sudo may even connect
        os.chown(tmp, 0, grp.getgrnam("sudo").gr_gid)
        os.chmod(tmp, 0o660)
    except KeyError:
        os.chmod(tmp, 0o600)
    srv.listen(64)
    os.rename(tmp, SOCK)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
'''


def install(root: Path) -> str:
    """Write the broker and shim into the rootfs at ``root``; return the shell snippet
    to run in the chroot afterwards (divert the real sudo, add ``user`` to ``sudo``)."""
    broker = root / BROKER_PATH.lstrip("/")
    broker.parent.mkdir(parents=True, exist_ok=True)
    broker.write_text(BROKER)
    broker.chmod(0o755)
    shim_tmp = root / "usr/lib/forkyard-sudo-shim"
    shim_tmp.write_text(SHIM)
    shim_tmp.chmod(0o755)
    return f"""
    if [ ! -e {REAL_SUDO} ]; then
        dpkg-divert --local --rename --divert {REAL_SUDO} --add {SHIM_PATH}
    fi
    install -m 0755 -o root -g root /usr/lib/forkyard-sudo-shim {SHIM_PATH}
    rm -f /usr/lib/forkyard-sudo-shim
    """
