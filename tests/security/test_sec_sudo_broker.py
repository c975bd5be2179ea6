"""The sudo broker (root, in every sandbox) serves only root and group ``sudo``: an
account outside it cannot reach it, cannot forge the credentials it checks, cannot
start a broker of its own on its socket, and cannot write where the socket lives.
Real sandbox (``base``'s Python broker; envd's broker of the other templates listens on
the same socket with the same mode, see tests/test_template_registry.py), real gVisor
kernel: what the brokers rely on is measured here, not assumed."""

from __future__ import annotations

import json

from e2b import Sandbox

PROBE = r'''
import errno, json, os, socket, struct, subprocess
out = {"uid": os.getuid()}
SOCK = "/run/forkyard/sudo.sock"
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(SOCK); out["connect"] = "ok"
except OSError as e:
    out["connect"] = errno.errorcode[e.errno]

def send_creds(pid, uid, gid):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    try:
        anc = [] if pid is None else [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, struct.pack("3i", pid, uid, gid))]
        a.sendmsg([b"x"], anc)
    except OSError as e:
        return errno.errorcode[e.errno]
    _, anc, _, _ = b.recvmsg(1, socket.CMSG_SPACE(12))
    return [list(struct.unpack("3i", d[:12])) for lvl, kind, d in anc if kind == socket.SCM_CREDENTIALS]

me = (os.getpid(), os.getuid(), os.getgid())
out["forge_uid0"] = send_creds(me[0], 0, me[2])
out["forge_gid_sudo"] = send_creds(me[0], me[1], 27)
out["forge_pid1"] = send_creds(1, me[1], me[2])
out["none_sent"] = send_creds(None, 0, 0)
out["own"] = send_creds(*me)
before = os.stat(SOCK).st_ino
p = subprocess.run(["bash", "-c", "exec -a sudo-broker /usr/local/bin/envd"], capture_output=True, text=True, timeout=10)
p2 = subprocess.run(["bash", "-c", "exec -a sudo-broker /usr/local/lib/forkyard/sudo-broker"], capture_output=True,
                    text=True, timeout=10)
out["own_broker_rc"] = [p.returncode, p2.returncode]
out["socket_same"] = os.stat(SOCK).st_ino == before
out["writable"] = [d for d in ("/run", "/run/forkyard") if os.access(d, os.W_OK)]
s2 = subprocess.run(["sudo", "-n", "id", "-u"], capture_output=True, text=True, timeout=20)
out["sudo"] = [s2.returncode, s2.stdout, s2.stderr]
print(json.dumps(out))
'''


def test_non_sudoer_cannot_use_or_fool_the_broker(sandbox: Sandbox):
    r = sandbox.commands.run("useradd -m -s /bin/bash eve && id eve", user="root")
    assert "sudo" not in r.stdout
    sandbox.files.write("/tmp/probe.py", PROBE, user="root")
    r = sandbox.commands.run("python3 /tmp/probe.py", user="eve", timeout=60)
    out = json.loads(r.stdout)
    uid = out["uid"]
    assert uid != 0
    assert out["connect"] == "EACCES", out
    # gVisor checks SCM_CREDENTIALS as Linux does: no uid, gid or pid but one's own
    assert out["forge_uid0"] == "EPERM", out
    assert out["forge_gid_sudo"] == "EPERM", out
    assert out["forge_pid1"] == "EPERM", out
    assert out["none_sent"] and out["none_sent"][0][1] == uid, out  # SO_PASSCRED fills in the sender's own
    assert out["own"] and out["own"][0][1] == uid, out
    assert out["own_broker_rc"][0] != 0 and out["socket_same"], out
    assert out["writable"] == [], out
    assert out["sudo"][0] == 1 and "not allowed" in out["sudo"][2], out
    # and the real sudoer still gets root
    assert sandbox.commands.run("sudo -n id -u", user="user").stdout.strip() == "0"


def test_envd_broker_same_guarantees(sandbox: Sandbox):
    """envd's Go broker (what every non-base template runs), swapped in for base's."""
    setup = """
useradd -m -s /bin/bash eve
old=$(stat -c %i /run/forkyard/sudo.sock)
for p in $(pgrep -f '^/usr/bin/python3 -I /usr/local/lib/forkyard/sudo-broker'); do kill $p; done
mkdir -p /opt/gosudo && ln -sf /usr/local/bin/envd /opt/gosudo/sudo && ln -sf /usr/local/bin/envd /opt/gosudo/sudo-broker
setsid /opt/gosudo/sudo-broker </dev/null >/tmp/gobroker.log 2>&1 &
for i in $(seq 100); do [ "$(stat -c %i /run/forkyard/sudo.sock)" != "$old" ] && break; sleep 0.05; done
pgrep -af sudo-broker; stat -c '%a %U:%G' /run/forkyard/sudo.sock
"""
    sandbox.files.write("/tmp/setup.sh", setup, user="root")
    r = sandbox.commands.run("bash /tmp/setup.sh", user="root", timeout=30)
    assert "/opt/gosudo/sudo-broker" in r.stdout and "python3" not in r.stdout and "660 root:sudo" in r.stdout, r.stdout
    sandbox.files.write("/tmp/probe.py", PROBE.replace('["sudo", "-n"', '["/opt/gosudo/sudo", "-n"'), user="root")
    out = json.loads(sandbox.commands.run("python3 /tmp/probe.py", user="eve", timeout=60).stdout)
    assert out["connect"] == "EACCES" and out["forge_uid0"] == "EPERM" and out["socket_same"], out
    assert out["sudo"][0] == 1 and "not allowed" in out["sudo"][2], out
    # a huge or bogus request from a sudoer is refused, the broker keeps serving
    bogus = ("python3 -c \"import socket,struct; s=socket.socket(socket.AF_UNIX); "
             "s.connect('/run/forkyard/sudo.sock'); s.sendall(struct.pack('>I', 0xffffffff)); "
             "print(s.recv(4))\"")
    assert "\\x00\\x00\\x00\\x01" in sandbox.commands.run(bogus, user="user", timeout=20).stdout
    assert sandbox.commands.run("/opt/gosudo/sudo -n id -u", user="user").stdout.strip() == "0"
