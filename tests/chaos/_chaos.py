"""The chaos suite's instruments: probe sandboxes, a poller that measures what clients
see, a mixed SDK workload, the figures table and the per-node leak check.

* **Probes** (:class:`Probes`): long-lived sandboxes made before a fault — running ones
  with a value held only in a process's memory (the counter server of
  ``test_lifecycle.COUNTER``, port 8000) and paused ones (their counter in the image).
  After the fault each running probe must still answer with its value through the
  gateway and each paused one must still be listed as paused (and, where the fault
  could have moved it, resume with its value). What does not is **lost**.
* **Poller** (:class:`Poller`): reads every running probe's counter through the gateway
  every 0.25 s during the fault: the failures are the **client-visible errors**, their
  span the **error duration**.
* **Workload** (:class:`Workload`): the E2B SDK doing create / exec / pause / resume /
  fork / kill in a loop across the fault (bench/soak.py's mix, shortened); its errors
  are counted per operation.
* **Recovery time**: from the end of the fault until every surviving probe answers
  and a create succeeds.
* **Leaks** (:func:`leaks`): per node, runsc containers no sandbox row accounts for,
  rows the cluster no longer routes to the node, and network namespaces beyond its
  sandboxes and spare slots.

Figures go to :data:`FIGURES` and are printed as one table at the end of the session
(tests/chaos/conftest.py) and written to ``$FORKYARD_CHAOS_REPORT`` when set.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from _cluster import Cluster
from e2b import Sandbox
from test_cluster import wait_for
from test_lifecycle import COUNTER

from forkyard.config import Settings

#: Every figure row recorded in this session (printed by conftest.py).
FIGURES: list[dict] = []
#: Long variants (Redis/scheduler down 30 and 60 s, …) run only with FORKYARD_CHAOS_LONG=1
#: (bench/chaos.py sets it).
LONG = os.environ.get("FORKYARD_CHAOS_LONG") == "1"
#: Faults run only by bench/chaos.py (FORKYARD_CHAOS_LONG=1): the default suite (CI, ~45 min
#: in all) keeps the three of issue 19's release-blocking kind — Redis down, every scheduler
#: down, a node lost — and this leaves the rest to the bench.
bench_only = pytest.mark.skipif(not LONG, reason="run by bench/chaos.py (FORKYARD_CHAOS_LONG=1); CI keeps Redis down, "
                                                 "schedulers killed and node killed")


def gw_get(c: Cluster, sid: str, path: str = "/", timeout: float = 3.0) -> httpx.Response:
    """``GET path`` on sandbox ``sid``'s port 8000 through the gateway."""
    return httpx.get(f"{c.gateway_url}{path}", timeout=timeout,
                     headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8000"})


def read_counter(c: Cluster, sid: str, wait_s: float = 20.0) -> int | None:
    """The probe's in-memory value through the gateway, or None if it does not answer
    within ``wait_s``."""
    deadline = time.time() + wait_s
    while True:
        try:
            r = gw_get(c, sid)
            if r.status_code == 200:
                return int(r.text)
        except (httpx.HTTPError, ValueError):
            pass
        if time.time() > deadline:
            return None
        time.sleep(0.2)


def start_counter(c: Cluster, sbx: Sandbox, value: int) -> None:
    sbx.files.write("/home/user/counter.py", COUNTER)
    sbx.commands.run("python3 /home/user/counter.py", background=True, timeout=0)
    deadline = time.time() + 20
    while True:
        try:
            if gw_get(c, sbx.sandbox_id, f"/set/{value}").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            raise AssertionError(f"counter in {sbx.sandbox_id} did not start")
        time.sleep(0.1)


@dataclass
class Probe:
    sid: str
    value: int
    paused: bool
    node: str | None = None


class Probes:
    """The probe sandboxes of one cluster (kept across the tests of a module)."""

    def __init__(self, c: Cluster):
        self.c = c
        self.all: dict[str, Probe] = {}
        self._n = 0

    @property
    def running(self) -> list[Probe]:
        return [p for p in self.all.values() if not p.paused]

    @property
    def paused(self) -> list[Probe]:
        return [p for p in self.all.values() if p.paused]

    def ensure(self, running: int = 3, paused: int = 2) -> None:
        """Top up to ``running`` running and ``paused`` paused probes (placement spreads
        them over the nodes) and record where each lives."""
        while len(self.running) < running or len(self.paused) < paused:
            self._n += 1
            value = 1000 + self._n
            sbx = Sandbox.create("base", timeout=3600, **self.c.sdk)
            start_counter(self.c, sbx, value)
            p = Probe(sbx.sandbox_id, value, False)
            if len(self.paused) < paused and len(self.running) >= running:
                sbx.pause()
                p.paused = True
            self.all[p.sid] = p
        for p in self.all.values():
            p.node = self.c.owner(p.sid)

    def on(self, node: str) -> list[Probe]:
        return [p for p in self.all.values() if p.node == node]

    def check(self, resume_paused: bool = False, expect_lost: set[str] = frozenset()) -> tuple[list[str], list[str]]:
        """``(running lost, paused lost)`` ids. A running probe is lost when it does not
        answer with its value; a paused one when it is no longer listed as paused (or,
        with ``resume_paused``, does not come back with its value — it is paused again
        afterwards). Lost probes are dropped from the set; ``expect_lost`` ones (running
        probes of a node declared down: reported gone, and stopped by their node once it
        hears of it) are dropped and counted lost without a look."""
        lost_r, lost_p = [], []
        with self.c.api() as api:
            for p in list(self.all.values()):
                if p.sid in expect_lost and not p.paused:
                    lost_r.append(p.sid)
                elif p.paused:
                    r = api.get(f"/sandboxes/{p.sid}")
                    ok = r.status_code == 200 and r.json().get("state") == "paused"
                    if ok and resume_paused:
                        back = Sandbox.connect(p.sid, timeout=3600, **self.c.sdk)
                        ok = read_counter(self.c, p.sid) == p.value
                        if ok:
                            back.pause()
                    if not ok:
                        lost_p.append(p.sid)
                else:
                    ok = read_counter(self.c, p.sid, wait_s=20) == p.value
                    if not ok and api.get(f"/sandboxes/{p.sid}").json().get("state") == "paused":
                        Sandbox.connect(p.sid, timeout=3600, **self.c.sdk)  # paused by a drain: not lost
                        ok = read_counter(self.c, p.sid) == p.value
                    if not ok:
                        lost_r.append(p.sid)
        for sid in lost_r + lost_p:
            self.all.pop(sid, None)
        for p in self.all.values():
            p.node = self.c.owner(p.sid)
        return lost_r, lost_p


class Poller:
    """Reads every running probe's counter through the gateway every ``period_s`` in a
    thread. :attr:`fails`: every read that failed or took longer than ``timeout_s``
    (``(time, id, why)``); :attr:`errors`: those that were answered with an error or could
    not connect (what "traffic keeps flowing" must not see; a slow read on an overloaded
    host is not one); :attr:`span_s`: from the first failure to the last."""

    def __init__(self, c: Cluster, probes: list[Probe], period_s: float = 0.25, timeout_s: float = 5.0):
        self.c, self.probes, self.period_s, self.timeout_s = c, list(probes), period_s, timeout_s
        self.fails: list[tuple[float, str, str]] = []
        self.reads = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Poller:
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(timeout=30)

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as h:
            while not self._stop.is_set():
                for p in self.probes:
                    t = time.time()
                    try:
                        r = h.get(f"{self.c.gateway_url}/", headers={"E2b-Sandbox-Id": p.sid, "E2b-Sandbox-Port": "8000"})
                        why = None if r.status_code == 200 and r.text == str(p.value) else f"{r.status_code} {r.text[:80]}"
                    except httpx.HTTPError as e:
                        why = type(e).__name__
                    self.reads += 1
                    if why is not None:
                        self.fails.append((t, p.sid, why))
                self._stop.wait(self.period_s)

    @property
    def errors(self) -> list[tuple[float, str, str]]:
        return [f for f in self.fails if not f[2].endswith("Timeout")]

    @property
    def span_s(self) -> float:
        return round(self.fails[-1][0] - self.fails[0][0], 1) if self.fails else 0.0


class Workload:
    """The e2b SDK doing a mixed lifecycle in a thread (create, exec, pause, resume,
    fork, kill) until stopped; errors counted per operation. Everything it made is
    killed by :meth:`__exit__` (what cannot be killed is reported as leaked)."""

    OPS = ("create", "exec", "pause", "resume", "fork", "kill")

    def __init__(self, c: Cluster, seed: int = 1, op_timeout_s: float = 30):
        self.c, self.rng, self.op_timeout_s = c, random.Random(seed), op_timeout_s
        self.ok: dict[str, int] = {op: 0 for op in self.OPS}
        self.errors: dict[str, list[str]] = {op: [] for op in self.OPS}
        self.mine: dict[str, bool] = {}  # id -> paused
        self.leaked: list[str] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Workload:
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(timeout=120)
        with self.c.api() as api:
            for sid in list(self.mine):
                for _ in range(30):
                    try:
                        r = api.delete(f"/sandboxes/{sid}", timeout=30)
                        if r.status_code in (204, 404):
                            break
                    except httpx.HTTPError:
                        pass
                    time.sleep(1)
                else:
                    self.leaked.append(sid)

    def _one(self, op: str) -> None:
        sdk = dict(self.c.sdk, request_timeout=self.op_timeout_s)
        running = [s for s, p in self.mine.items() if not p]
        paused = [s for s, p in self.mine.items() if p]
        if op == "create" or not self.mine:
            s = Sandbox.create("base", timeout=600, **sdk)
            self.mine[s.sandbox_id] = False
        elif op == "exec" and running:
            s = Sandbox.connect(self.rng.choice(running), **sdk)
            assert s.commands.run("echo ok", request_timeout=self.op_timeout_s).stdout == "ok\n"
        elif op == "pause" and running:
            sid = self.rng.choice(running)
            Sandbox.connect(sid, **sdk).pause()
            self.mine[sid] = True
        elif op == "resume" and paused:
            sid = self.rng.choice(paused)
            Sandbox.connect(sid, timeout=600, **sdk)
            self.mine[sid] = False
        elif op == "fork" and running:
            with self.c.api() as api:
                r = api.post(f"/sandboxes/{self.rng.choice(running)}/fork", json={"count": 1, "timeout": 600},
                             timeout=self.op_timeout_s)
            assert r.status_code == 201, f"{r.status_code} {r.text[:200]}"
            for x in r.json():
                if "sandbox" in x:
                    self.mine[x["sandbox"]["sandboxID"]] = False
                else:
                    raise AssertionError(str(x)[:200])
        elif op == "kill" and len(self.mine) > 1:
            sid = self.rng.choice(list(self.mine))
            Sandbox.kill(sid, **sdk)
            self.mine.pop(sid, None)
        else:
            return
        self.ok[op] += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            op = self.rng.choice(self.OPS) if len(self.mine) < 4 else self.rng.choice(self.OPS[1:])
            try:
                self._one(op)
            except Exception as e:  # noqa: BLE001 — a client-visible error: counted
                self.errors[op].append(f"{type(e).__name__}: {str(e)[:160]}")
                self._stop.wait(0.3)

    def summary(self) -> str:
        """``N ok, errors op=K …`` and the first error of each operation that failed."""
        errs = {op: len(v) for op, v in self.errors.items() if v}
        done = sum(self.ok.values())
        if not errs:
            return f"{done} ok, 0 errors"
        first = "; ".join(f"{op}: {v[0][:90]}" for op, v in self.errors.items() if v)
        return f"{done} ok, errors " + " ".join(f"{k}={v}" for k, v in errs.items()) + f" ({first})"


def recovery_s(c: Cluster, probes: list[Probe], t0: float, timeout_s: float = 120) -> float:
    """Seconds from ``t0`` (the end of the fault) until every probe in ``probes`` answers
    and the control plane takes creates again (the start of the first create that
    succeeds; it is killed again)."""
    deadline = time.time() + timeout_s
    pending = list(probes)
    created, t_probes = None, None
    while time.time() < deadline:
        pending = [p for p in pending if read_counter(c, p.sid, wait_s=0) != p.value]
        if not pending and t_probes is None:
            t_probes = time.time()
        if created is None:
            t = time.time()
            try:
                s = Sandbox.create("base", timeout=60, request_timeout=20, **c.sdk)
                s.kill()
                created = t  # the control plane took the create when it was sent
            except Exception:  # noqa: BLE001 — not recovered yet
                pass
        if created is not None and t_probes is not None:
            return round(max(created, t_probes, t0) - t0, 1)
        time.sleep(0.2)
    raise AssertionError(f"not recovered {timeout_s} s after the fault: probes {[p.sid for p in pending]}, "
                         f"create ok={created}")


def record(fault: str, *, running_lost: int, paused_lost: int, poller: Poller | None, recovery: float | None,
           workload: Workload | None = None, note: str = "") -> dict:
    """Add one row to :data:`FIGURES` and return it."""
    if poller and poller.errors:  # what clients saw, most frequent first
        seen: dict[str, int] = {}
        for _, _, why in poller.errors:
            seen[why[:90]] = seen.get(why[:90], 0) + 1
        top = ", ".join(f"{n}× {w}" for w, n in sorted(seen.items(), key=lambda kv: -kv[1])[:2])
        note = f"{note}; reads failed with {top}" if note else f"reads failed with {top}"
    if poller and len(poller.fails) > len(poller.errors):
        slow = len(poller.fails) - len(poller.errors)
        note = f"{note}; {slow} read(s) over {poller.timeout_s:.0f} s" if note else f"{slow} read(s) over {poller.timeout_s:.0f} s"
    row = {"fault": fault, "running_lost": running_lost, "paused_lost": paused_lost,
           "errors": f"{len(poller.errors)}/{poller.reads}" if poller else "-",
           "error_span_s": poller.span_s if poller else "-", "recovery_s": recovery if recovery is not None else "-",
           "workload": workload.summary() if workload else "-", "note": note}
    FIGURES.append(row)
    print(f"\nCHAOS {json.dumps(row)}", flush=True)
    return row


def leaks(c: Cluster) -> dict[str, list[str]]:
    """Per node (``node0`` …): what it holds that nobody accounts for — runsc containers
    without a sandbox row, running rows the cluster routes elsewhere (or not at all),
    network namespaces beyond its running sandboxes and spare slots. Empty lists: clean."""
    from forkyard.network.slots import NetnsNetwork

    out: dict[str, list[str]] = {}
    key = {"X-API-Key": c.api_key}
    for i, n in enumerate(c.nodes):
        name, found = f"node{i}", []
        if not n.running():
            out[name] = ["node not running"]
            continue
        data = Path(n.env["FORKYARD_DATA_DIR"])
        r = httpx.get(f"{c.node_urls[i]}/v2/sandboxes", params={"limit": 100}, headers=key, timeout=30)
        rows = {x["sandboxID"]: x["state"] for x in r.json()}
        ls = subprocess.run([Settings().runsc, f"--root={data / 'runsc'}", "list", "-format=json"],
                            capture_output=True, text=True)
        containers = {x["id"] for x in json.loads(ls.stdout or "[]") or []} if ls.returncode == 0 else set()
        running = {s for s, st in rows.items() if st == "running"}
        found += [f"runsc container {cid} has no sandbox row" for cid in sorted(containers - running)
                  if not cid.startswith(("spare", "pool"))]
        for sid in sorted(running):
            owner = c.owner(sid)
            if owner != name:
                found.append(f"sandbox {sid} runs here but is bound to {owner}")
        nm = NetnsNetwork(Settings(data_dir=data), outer_net=n.env["FORKYARD_OUTER_NET"],
                          prefix=n.env["FORKYARD_NET_PREFIX"])
        spare = int(n.env.get("FORKYARD_SPARE_SLOTS", "16"))
        extra = len(nm.existing_indexes()) - len(running) - spare
        if extra > 0:
            found.append(f"{extra} network namespace(s) beyond its sandboxes and {spare} spare slots")
        out[name] = found
    return out


def create_on(c: Cluster, i: int, value: int | None = None, paused: bool = False) -> Probe:
    """A sandbox made on node ``i`` itself (its own REST API: the node publishes it, so
    the cluster routes it like any other), with a counter ``value`` when given, paused
    when ``paused``."""
    r = httpx.post(f"{c.node_urls[i]}/sandboxes", json={"templateID": "base", "timeout": 3600},
                   headers={"X-API-Key": c.api_key}, timeout=120)
    assert r.status_code == 201, r.text
    sbx = Sandbox.connect(r.json()["sandboxID"], **c.sdk)
    p = Probe(sbx.sandbox_id, value or 0, paused, f"node{i}")
    if value is not None:
        start_counter(c, sbx, value)
    if paused:
        sbx.pause()
    return p


def runsc_ids(c: Cluster, i: int) -> set[str]:
    """Ids of the runsc containers under node ``i``'s runsc root (running or not)."""
    root = Path(c.nodes[i].env["FORKYARD_DATA_DIR"]) / "runsc"
    out = subprocess.run([Settings().runsc, f"--root={root}", "list", "-quiet"], capture_output=True, text=True)
    return set(out.stdout.split())


#: polls ``pred`` until truthy (test_cluster's helper, under the name the chaos tests use)
wait_until = wait_for


def parallel(fns) -> list:
    """Run the callables at once; their results in order (exceptions re-raised)."""
    with concurrent.futures.ThreadPoolExecutor(len(fns)) as pool:
        return [f.result() for f in [pool.submit(fn) for fn in fns]]


@dataclass
class Window:
    """A fault's start and end (time.time())."""

    start: float = 0.0
    end: float = 0.0
    notes: list[str] = field(default_factory=list)
