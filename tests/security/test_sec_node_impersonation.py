"""Issue 25, item 6: node impersonation in a cluster, and the Redis behind it.

Every node, the scheduler and the gateway shared one secret: a process holding it (or
able to write Redis) heartbeated for a node id with its own ``url`` and an inflated
capacity and received the gateway's creates (users' ``envVars``) and sandbox calls, each
carrying the secret. Now a node holds only its own key, bound to its id and URL
(:mod:`forkyard.cluster.nodekeys`). Attacks, against a real redis-server, scheduler,
gateway and node (tests/_cluster.py); the attacker is a plain HTTP listener that records
whatever reaches it:

* a fake node heartbeating with the shared secret (the old path), with another node's
  key, or with a node's key but another URL is refused and gets no placement, request or
  credential;
* a node record written straight into Redis (a new id, or a real node's id pointed at the
  attacker) gets no traffic and no credential;
* the Redis the deploy path starts refuses unauthenticated clients, keeps its files
  private, and forkyard never shows its password.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from conftest import TEST_ROOT, free_port

SECRET_HEADER, URL_HEADER = "x-forkyard-cluster-secret", "x-forkyard-node-url"
CANARY = "canary-" + os.urandom(6).hex()
REPO = Path(__file__).resolve().parents[2]


class Attacker:
    """An HTTP listener on loopback that answers 200 ``{}`` and records every request."""

    def __init__(self):
        seen = self.seen = []

        class H(BaseHTTPRequestHandler):
            def _any(self):
                n = int(self.headers.get("content-length") or 0)
                seen.append((self.command, self.path, dict(self.headers), self.rfile.read(n) if n else b""))
                body = b"{}"
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_DELETE = _any

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def cluster(base_template):
    from _cluster import Cluster

    c = Cluster(TEST_ROOT / f"cluster-impersonation-{os.getpid()}", nodes=1)
    try:
        c.start()
        yield c
    finally:
        c.close()


@pytest.fixture
def attacker():
    a = Attacker()
    yield a
    a.close()


def _inflated(c) -> dict:
    """node0's last report with room for thousands of sandboxes (what the attacker claims)."""
    with c.sched() as s:
        rep = next(n for n in s.get("/v1/nodes").json() if n["nodeID"] == "node0")["report"]
    return {**rep, "max_sandboxes": 5000, "vcpus": 512, "memory_mb": 1 << 21, "running": 0, "load1": 0.0,
            "boot": "evil"}


def _create_some(c, n: int = 3) -> list[dict]:
    """``n`` creates through the gateway, each with a user's env var; their answers."""
    out = []
    with c.api() as api:
        for _ in range(n):
            r = api.post("/sandboxes", json={"templateID": "base", "timeout": 120, "envVars": {"TOKEN": CANARY}})
            out.append({"status": r.status_code, **(r.json() if r.headers.get("content-type", "").startswith(
                "application/json") else {})})
    return out


def _kill(c, answers: list[dict]) -> None:
    with c.api() as api:
        for a in answers:
            if a.get("sandboxID"):
                api.delete(f"/sandboxes/{a['sandboxID']}")


def _assert_nothing_leaked(c, attacker: Attacker) -> None:
    got = b"".join(json.dumps(h).encode() + body for _, _, h, body in attacker.seen)
    leaked = [w for w, v in (("the cluster secret", c.secret), ("a user's env var", CANARY)) if v.encode() in got]
    assert not attacker.seen, (f"the attacker received {len(attacker.seen)} request(s) "
                               f"{[(m, p) for m, p, _, _ in attacker.seen[:5]]}, carrying {leaked or 'nothing secret'}")


def _owners(c, answers: list[dict]) -> set[str | None]:
    with c.sched() as s:
        return {s.get(f"/v1/sandboxes/{a['sandboxID']}").json().get("nodeID") for a in answers if a.get("sandboxID")}


def test_fake_node_heartbeats_are_refused_and_get_nothing(cluster, attacker):
    """Heartbeats for a node id with the attacker's URL and a huge capacity, sent while
    users create sandboxes: with the shared secret (the old path), with node0's key for
    another id, with node0's key for another URL, with a body URL other than the one its
    key is bound to. None is taken; every create lands on node0; nothing reaches the
    attacker; a node key opens no other scheduler route."""
    c = cluster
    key0, url0 = c.nodes[0].env["FORKYARD_NODE_KEY"], c.node_urls[0]
    report = _inflated(c)
    tries = [("evil", c.secret, attacker.url, attacker.url),   # the shared secret, as before
             ("node0", c.secret, attacker.url, attacker.url),
             ("evil", key0, url0, attacker.url),               # another node's key
             ("evil", key0, attacker.url, attacker.url),
             ("node0", key0, attacker.url, attacker.url),      # its key, rebound URL
             ("node0", key0, url0, attacker.url)]              # the URL in the body differs
    answers: dict[int, set] = {i: set() for i in range(len(tries))}
    stop = threading.Event()

    def beat():
        with httpx.Client(timeout=5, trust_env=False) as h:
            while not stop.is_set():
                for i, (nid, cred, hdr_url, body_url) in enumerate(tries):
                    r = h.post(f"{c.scheduler_url}/v1/nodes/{nid}/heartbeat",
                               json={"url": body_url, "report": report, "held": []},
                               headers={SECRET_HEADER: cred, URL_HEADER: hdr_url})
                    answers[i].add((r.status_code, r.json().get("message", "")[:80]))
                stop.wait(0.2)

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    try:
        time.sleep(0.5)
        created = _create_some(c)
    finally:
        stop.set()
        t.join(10)
    try:
        _assert_nothing_leaked(c, attacker)
        assert all(a["status"] == 201 for a in created), created
        assert _owners(c, created) == {"node0"}
        for i, seen in answers.items():
            assert {s for s, _ in seen} <= {401, 403} and all(m for _, m in seen), (tries[i][:1], seen)
        with c.sched() as s:
            nodes = {n["nodeID"]: n["url"] for n in s.get("/v1/nodes").json()}
            assert nodes == {"node0": url0}, nodes
            # node0's key opens only node0's own calls: not placements, drains or listings
            h = {SECRET_HEADER: key0, URL_HEADER: url0}
            assert s.post("/v1/placements", json={"kind": "create"}, headers=h).status_code == 403
            assert s.post("/v1/nodes/node0/drain", headers=h).status_code == 403
            assert s.get("/v1/nodes", headers=h).status_code == 403
            assert s.post("/v1/nodes/evil/publish", json={"records": []}, headers=h).status_code == 403
    finally:
        _kill(c, created)


def test_node_record_planted_in_redis_gets_no_traffic(cluster, attacker):
    """Whoever can write Redis (but holds no cluster secret) plants a live node ``evil``
    at the attacker's URL with a huge capacity (copying node0's tag), binds a sandbox to
    it, and points node0's own record at the attacker: creates still land on node0 and
    the attacker receives no request and no credential."""
    import redis

    c = cluster
    r = redis.Redis.from_url(c.redis_url)
    report = json.dumps(_inflated(c))
    tag0 = r.hget("fy:node:node0", "tag") or b""
    with c.api() as api:
        victim = api.post("/sandboxes", json={"templateID": "base", "timeout": 120}).json()["sandboxID"]
    stop, hijack = threading.Event(), threading.Event()

    def plant():
        while not stop.is_set():
            sec, usec = r.time()
            with r.pipeline() as p:
                p.sadd("fy:nodes", "evil")
                p.hset("fy:node:evil", mapping={"url": attacker.url, "status": "up", "boot": "evil", "tag": tag0,
                                                "last_seen": f"{sec + usec / 1e6:.6f}", "report": report})
                p.hset(f"fy:sbx:{victim}", "node", "evil")
                if hijack.is_set():
                    p.hset("fy:node:node0", mapping={"url": attacker.url, "tag": tag0})
                p.execute()
            stop.wait(0.05)

    t = threading.Thread(target=plant, daemon=True)
    t.start()
    created = []
    try:
        time.sleep(0.5)
        created = _create_some(c)
        with c.api() as api:
            for _ in range(3):
                api.get(f"/sandboxes/{victim}")
                api.get("/health", headers={"e2b-sandbox-id": victim, "e2b-sandbox-port": "49983"})
        hijack.set()
        deadline = time.time() + 2
        with c.api() as api:
            while time.time() < deadline:
                api.get(f"/sandboxes/{victim}")
                api.post("/sandboxes", json={"templateID": "base", "timeout": 30, "envVars": {"TOKEN": CANARY}})
                time.sleep(0.1)
    finally:
        stop.set()
        t.join(10)
        r.delete("fy:node:evil")
        r.srem("fy:nodes", "evil")
    try:
        _assert_nothing_leaked(c, attacker)
        assert all(a["status"] == 201 for a in created), created
        assert _owners(c, created) == {"node0"}
    finally:
        _kill(c, created)
        with c.api() as api:  # creates that landed during the hijack, and the victim
            for s in api.get("/v2/sandboxes").json():
                api.delete(f"/sandboxes/{s['sandboxID']}")


def test_deploy_redis_refuses_unauthenticated_clients(tmp_path):
    """The Redis of deploy/install-cluster.sh (its redis.conf and generated password file,
    run with the unit's umask) refuses a client without the password, listens on
    loopback only and writes its AOF/RDB files 0600; forkyard reads the password from
    FORKYARD_REDIS_PASSWORD_FILE and never shows it in a message."""
    import redis

    from forkyard.cluster.config import redis_url
    from forkyard.cluster.store import ClusterStore, ClusterStoreUnavailable

    root = tmp_path / "root"
    subprocess.run(["bash", str(REPO / "deploy/install-cluster.sh"), "--root", str(root), "--roles", "redis"],
                   check=True, capture_output=True)
    etc = root / "etc/forkyard"
    pw_file = etc / "redis-secret.conf"
    assert pw_file.stat().st_mode & 0o777 == 0o600
    password = pw_file.read_text().split()[1]
    data = tmp_path / "redis"
    data.mkdir(mode=0o700)
    port = free_port()
    conf = (etc / "redis.conf").read_text().replace("dir /var/lib/forkyard-redis", f"dir {data}") \
        .replace("port 6379", f"port {port}")
    (etc / "redis.conf").write_text(conf)
    proc = subprocess.Popen(["sh", "-c", 'umask 077 && exec redis-server "$1" --include "$2"', "sh",
                             str(etc / "redis.conf"), str(pw_file)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 20
        while True:
            try:  # raw RESP: no client library that might authenticate or retry
                with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                    s.sendall(b"PING\r\nAUTH wrong-password\r\nGET fy:nodes\r\n")
                    time.sleep(0.2)
                    answer = s.recv(500)
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, "redis-server did not start"
                time.sleep(0.1)
        assert answer.startswith(b"-NOAUTH") and b"-WRONGPASS" in answer and answer.count(b"\r\n-") == 2, answer
        authed = redis.Redis(port=port, password=password)
        assert set(authed.config_get("bind")["bind"].split()) <= {"127.0.0.1", "-::1", "::1"}
        assert authed.config_get("protected-mode")["protected-mode"] == "yes"
        authed.set("fy:probe", "x")
        authed.save()
        authed.bgrewriteaof()
        time.sleep(1)
        files = [p for p in data.rglob("*") if p.is_file()]
        assert files and all(p.stat().st_mode & 0o777 == 0o600 for p in files), \
            [(str(p), oct(p.stat().st_mode)) for p in files]

        async def probe(url: str) -> str:
            store = ClusterStore(url, timeout_s=2)
            try:
                await store.now()
                return "ok"
            except ClusterStoreUnavailable as e:
                return str(e)
            finally:
                await store.aclose()

        import asyncio

        env = {"FORKYARD_REDIS_URL": f"redis://127.0.0.1:{port}/0", "FORKYARD_REDIS_PASSWORD_FILE": str(pw_file)}
        assert asyncio.run(probe(redis_url(env))) == "ok"
        wrong_port = asyncio.run(probe(f"redis://:{password}@127.0.0.1:{free_port()}/0"))
        assert password not in wrong_port and ":***@" in wrong_port, wrong_port
    finally:
        proc.terminate()
        proc.wait(20)
