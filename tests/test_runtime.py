"""gVisor driver on the real host: real runsc, real netns slots, the real base template.

Init is a tiny HTTP server on the envd port (``python3 -m http.server 49983``) unless a
test says otherwise; commands inside run through ``runsc exec`` (test side channel).
Every sandbox is destroyed and every slot released by the fixtures, which then assert
that no process, runsc state, bundle, overlay, mount, cgroup, netns or veth is left.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

import _hostutil as hu
from forkyard.config import GUEST_IP
from forkyard.network.base import NetnsAttachment
from forkyard.runtime.base import RuntimeError_, SandboxSpec
from forkyard.runtime.gvisor import GVisorDriver
from forkyard.runtime.gvisor import disk as gdisk
from forkyard.runtime.gvisor import spec as ocispec
from forkyard.templates.base import build_base, is_protected


@pytest.fixture(scope="session")
def base_rootfs() -> Path:
    """The base template, built once under the test data root and cached across runs."""
    return build_base(hu.template_settings(), progress=lambda line: None)


@pytest.fixture(scope="module")
def settings():
    return hu.runtime_settings()


@pytest.fixture(scope="module")
def nm(settings):
    manager = hu.network_manager(settings)
    manager.setup_host()
    yield manager
    for idx in manager.existing_indexes():
        manager.release(idx)
    assert hu.netns_names() == []
    assert hu.host_links() == []
    manager.teardown_host()


@pytest.fixture(scope="module")
def driver(settings):
    return GVisorDriver(settings, init_argv=hu.HTTP_INIT)


@pytest.fixture
async def sandboxes(settings, nm, base_rootfs):
    """``make(index, sandbox_id, **spec_overrides) -> (spec, slot)`` (not started).

    Teardown destroys every sandbox named, releases every slot, and asserts clean."""
    made: list[tuple[SandboxSpec, int]] = []
    cleaner = GVisorDriver(settings, init_argv=hu.HTTP_INIT)

    def make(index: int, sandbox_id: str, **overrides) -> tuple[SandboxSpec, object]:
        # the session's slot letter in the id: cgroups (forkyard/<id>) are host-wide, and
        # parallel sessions must not share them
        sandbox_id = f"{sandbox_id}-{hu.LETTER}"
        slot = nm.allocate(index)
        spec = SandboxSpec(
            sandbox_id=sandbox_id,
            rootfs=base_rootfs,
            network=slot.attachment,
            vcpus=1,
            memory_mb=256,
            hostname="e2b.local",
            workdir=settings.sandboxes_dir / sandbox_id,
        )
        spec = replace(spec, **overrides)
        made.append((spec, index))
        return spec, slot

    yield make
    for spec, index in made:
        await cleaner.destroy(spec.sandbox_id, spec.workdir)
        hu.assert_sandbox_gone(settings, spec.sandbox_id, spec.workdir)
        nm.release(index)
        shutil.rmtree(spec.workdir, ignore_errors=True)
        assert f"{hu.TEST_PREFIX}{index}s" not in hu.netns_names() and f"{hu.TEST_PREFIX}v{index}" not in hu.host_links()


def http_get(ip: str, port: int = hu.HTTP_PORT, timeout: float = 15.0) -> int:
    """Poll ``http://ip:port/`` until it answers; return the status code."""
    deadline = time.time() + timeout
    last: Exception | None = None
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://{ip}:{port}/", timeout=2) as r:
                return r.status
        except Exception as e:  # noqa: BLE001
            last = e
            time.sleep(0.02)
    raise AssertionError(f"http://{ip}:{port}/ never answered: {last}")


#: ``user`` as envd runs it: uid/gid 1000 plus its /etc/group membership (sudo = 27).
USER = "1000:1000"
USER_GROUPS = [27]


def sh(settings, sandbox_id: str, script: str, user: str | None = None) -> str:
    groups = USER_GROUPS if user == USER else None
    r = hu.runsc_exec(settings, sandbox_id, ["/bin/sh", "-c", script], user=user, groups=groups)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stdout} {r.stderr}"
    return r.stdout


def py(settings, sandbox_id: str, code: str) -> str:
    r = hu.runsc_exec(settings, sandbox_id, ["python3", "-c", code])
    assert r.returncode == 0, f"exit {r.returncode}: {r.stdout} {r.stderr}"
    return r.stdout.strip()


# ------------------------------------------------------------------------------- basics


async def test_create_runs_in_its_slot(settings, driver, sandboxes):
    spec, slot = sandboxes(1, "rt-basic")
    await driver.create(spec)
    assert await driver.is_running(spec.sandbox_id)
    assert spec.sandbox_id in await driver.list_ids()
    assert http_get(slot.outer_ip) == 200  # host -> outer_ip:49983 -> guest (DNAT)
    assert (spec.workdir / "bundle" / "config.json").is_file()

    # Inside: the fixed guest address, our hostname, and it resolves (sudo needs that).
    src = py(settings, spec.sandbox_id,
             "import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
             "s.connect(('192.0.2.1', 9)); print(s.getsockname()[0])")
    assert src == GUEST_IP
    assert sh(settings, spec.sandbox_id, "hostname").strip() == "e2b.local"
    assert py(settings, spec.sandbox_id, "import socket; print(socket.gethostbyname('e2b.local'))") == "127.0.1.1"
    # envd's future user exists; root can switch to it (the real sudo works for root).
    assert sh(settings, spec.sandbox_id, "sudo -u user id -un").strip() == "user"


async def test_dns_and_egress_through_nat(settings, driver, sandboxes):
    spec, _ = sandboxes(2, "rt-egress")
    await driver.create(spec)
    resolved = py(settings, spec.sandbox_id, f"import socket; print(socket.gethostbyname({hu.mirror_host()!r}))")
    assert resolved.count(".") == 3
    out = py(settings, spec.sandbox_id, hu.CONNECT_SNIPPET.format(host=hu.nameserver(), port=53, timeout=3))
    assert out == "OK"


async def test_sandbox_cannot_reach_host_or_other_sandboxes(settings, driver, nm, sandboxes):
    a, _ = sandboxes(3, "rt-iso-a")
    b, slot_b = sandboxes(4, "rt-iso-b")
    await asyncio.gather(driver.create(a), driver.create(b))
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    threading.Thread(target=lambda: [c.close() for c, _ in iter(listener.accept, None)], daemon=True).start()
    try:
        targets = [
            (hu.host_source_ip(hu.nameserver()), port),  # the host's LAN address
            (nm.addresses(3)[0], port),  # own slot's host end (gateway side)
            (nm.addresses(4)[0], port),  # another slot's host end
            (slot_b.outer_ip, hu.HTTP_PORT),  # another sandbox
        ]
        for host, p in targets:
            out = py(settings, a.sandbox_id, hu.CONNECT_SNIPPET.format(host=host, port=p, timeout=1.5))
            assert out.startswith("FAIL"), f"sandbox reached {host}:{p}"
        assert http_get(slot_b.outer_ip) == 200  # control: the host reaches b
    finally:
        listener.close()


async def test_writes_stay_in_the_sandbox(settings, driver, sandboxes, base_rootfs):
    spec, _ = sandboxes(5, "rt-overlay")
    await driver.create(spec)
    assert is_protected(base_rootfs)
    before = sorted(p.name for p in (base_rootfs / "etc").iterdir())
    sh(settings, spec.sandbox_id,
       "echo probe > /etc/forkyard-probe && rm /usr/bin/less && mkdir -p /opt/new && "
       "head -c 20000000 /dev/urandom > /root/blob && echo x >> /etc/hostname.bak")
    assert sh(settings, spec.sandbox_id, "cat /etc/forkyard-probe").strip() == "probe"
    assert sh(settings, spec.sandbox_id, "test -e /usr/bin/less || echo gone").strip() == "gone"
    assert not (base_rootfs / "etc" / "forkyard-probe").exists()
    assert (base_rootfs / "usr" / "bin" / "less").exists()
    assert not (base_rootfs / "opt" / "new").exists()
    assert not (base_rootfs / "root" / "blob").exists()
    assert sorted(p.name for p in (base_rootfs / "etc").iterdir()) == before
    assert (spec.workdir / "overlay").is_dir()  # the sandbox's writable layer lives here
    # user can write its home; root-owned paths stay root-owned
    sh(settings, spec.sandbox_id, "touch /home/user/mine && ls -ln /home/user/mine", user=USER)


async def test_cpu_and_memory_limits_apply(settings, driver, sandboxes):
    spec, _ = sandboxes(6, "rt-limits", vcpus=1, memory_mb=256)
    await driver.create(spec)
    cg = Path("/sys/fs/cgroup")
    assert int((cg / f"memory/forkyard/{spec.sandbox_id}/memory.limit_in_bytes").read_text()) == 256 * 2**20
    assert int((cg / f"cpu/forkyard/{spec.sandbox_id}/cpu.cfs_quota_us").read_text()) == 100_000
    assert int((cg / f"cpu/forkyard/{spec.sandbox_id}/cpu.cfs_period_us").read_text()) == 100_000
    meminfo = sh(settings, spec.sandbox_id, "head -1 /proc/meminfo")
    assert meminfo.split()[1] == str(256 * 1024)  # MemTotal in kB follows the limit

    usage = cg / f"cpuacct/forkyard/{spec.sandbox_id}/cpuacct.usage"
    u0, t0 = int(usage.read_text()), time.monotonic()
    py(settings, spec.sandbox_id,
       "import multiprocessing as m, time\n"
       "def f():\n t=time.time()\n while time.time()-t<2: pass\n"
       "ps=[m.Process(target=f) for _ in range(2)]\n[p.start() for p in ps]\n[p.join() for p in ps]")
    cores = (int(usage.read_text()) - u0) / 1e9 / (time.monotonic() - t0)
    print(f"\n2 busy processes with vcpus=1 used {cores:.2f} cores")
    assert cores < 1.3


async def test_memory_limit_is_enforced(settings, driver, sandboxes):
    spec, _ = sandboxes(7, "rt-oom", memory_mb=256)
    await driver.create(spec)
    r = hu.runsc_exec(settings, spec.sandbox_id,
                      ["python3", "-c", "x = bytearray(400 * 2**20); print('allocated', len(x))"])
    mem = Path(f"/sys/fs/cgroup/memory/forkyard/{spec.sandbox_id}")
    oom = dict(line.split() for line in (mem / "memory.oom_control").read_text().splitlines())
    peak = int((mem / "memory.max_usage_in_bytes").read_text())
    print(f"\n400 MiB in a 256 MiB sandbox: exit {r.returncode}; oom_kill {oom.get('oom_kill')}; "
          f"peak {peak >> 20} MiB; {r.stderr.strip()[:200]}")
    # The allocation never completes and the limit held, whichever process the host's OOM
    # killer picked in the sandbox's memory cgroup.
    assert r.returncode != 0 and "allocated" not in r.stdout
    assert int(oom.get("oom_kill", 0)) >= 1
    assert peak <= (256 << 20) + (1 << 20), peak >> 10  # (the page counter may pass the limit by a page: seen once, +4 KiB)
    # Which one it picks (measured, docs/security.md "A sandbox killed for its resources"):
    # the sentry and the systrap stub of the allocating process hold about the same pages
    # (both map the memory file), so either can go. The sentry: the whole sandbox ends
    # (runsc exec loses its connection: exit 128). A stub: that process ends with SIGKILL
    # (137, as in an E2B VM) and the sandbox goes on, or — when its memory is not freed
    # before the next allocation — the sentry is picked next. Never a wedged sandbox:
    # within 15 s it is gone, or it answers a command and its memory is back.
    deadline, answered = time.time() + 15, None
    while time.time() < deadline:
        if not await driver.is_running(spec.sandbox_id):
            break
        if r.returncode == 137 and (answered := hu.runsc_exec(settings, spec.sandbox_id, ["echo", "alive"])).returncode == 0:
            break
        await asyncio.sleep(0.3)
    if answered is not None and answered.returncode == 0:
        assert answered.stdout.strip() == "alive"
        assert int((mem / "memory.usage_in_bytes").read_text()) < 128 << 20
    else:
        assert not await driver.is_running(spec.sandbox_id) and not await driver.alive(spec.sandbox_id)


# ------------------------------------------------------------------------ failure paths


async def test_destroy_is_idempotent(settings, driver, sandboxes):
    spec, _ = sandboxes(8, "rt-destroy")
    await driver.create(spec)
    await driver.destroy(spec.sandbox_id)  # workdir derived from runsc's state
    hu.assert_sandbox_gone(settings, spec.sandbox_id, spec.workdir)
    await driver.destroy(spec.sandbox_id, spec.workdir)
    await driver.destroy("rt-never-existed")
    assert not await driver.is_running(spec.sandbox_id)
    assert await driver.state(spec.sandbox_id) is None


async def test_failed_create_says_why_and_cleans_up(settings, sandboxes, tmp_path):
    spec, _ = sandboxes(9, "rt-badinit")
    driver = GVisorDriver(settings, init_argv=hu.HTTP_INIT)
    not_a_netns = tmp_path / "not-a-netns"
    not_a_netns.write_text("")
    with pytest.raises(RuntimeError_) as err:
        await driver.create(replace(spec, network=NetnsAttachment(str(not_a_netns))))
    assert f"runsc run {spec.sandbox_id} failed" in str(err.value)
    assert str(not_a_netns) in str(err.value)  # runsc's own words name the bad netns
    hu.assert_sandbox_gone(settings, spec.sandbox_id, spec.workdir)

    with pytest.raises(RuntimeError_, match="does not exist in rootfs"):
        await GVisorDriver(settings, init_argv=["/nonexistent/init"]).create(spec)
    with pytest.raises(RuntimeError_, match="network namespace"):
        await driver.create(replace(spec, network=NetnsAttachment("/run/netns/ft-missing")))
    with pytest.raises(RuntimeError_, match="rootfs"):
        await driver.create(replace(spec, rootfs=Path("/nonexistent-rootfs")))
    hu.assert_sandbox_gone(settings, spec.sandbox_id, spec.workdir)


async def test_missing_envd_binary_is_reported(settings, sandboxes, tmp_path):
    spec, _ = sandboxes(10, "rt-noenvd")
    no_envd = replace(settings, envd_binary=tmp_path / "envd")
    with pytest.raises(RuntimeError_, match="envd binary"):
        await GVisorDriver(no_envd).create(spec)
    hu.assert_sandbox_gone(settings, spec.sandbox_id, spec.workdir)


async def test_duplicate_id_is_refused_and_original_survives(settings, driver, sandboxes):
    spec, slot = sandboxes(11, "rt-dup")
    other, _ = sandboxes(12, "rt-dup")
    await driver.create(spec)
    with pytest.raises(RuntimeError_, match="already exists"):
        await driver.create(other)
    assert await driver.is_running(spec.sandbox_id)
    assert http_get(slot.outer_ip) == 200


# ---------------------------------------------------------------- checkpoint / restore


async def test_checkpoint_and_fork(settings, driver, sandboxes, nm):
    src, src_slot = sandboxes(13, "rt-src")
    await driver.create(src)
    http_get(src_slot.outer_ip)
    sh(settings, src.sandbox_id, "echo before > /root/state")
    image = settings.data_dir / "images" / "rt-src"
    shutil.rmtree(image, ignore_errors=True)
    try:
        t = time.perf_counter()
        await driver.checkpoint(src.sandbox_id, image, leave_running=True)
        ckpt_ms = 1000 * (time.perf_counter() - t)
        assert await driver.is_running(src.sandbox_id)
        assert http_get(src_slot.outer_ip) == 200

        kids = [sandboxes(14 + i, f"rt-kid{i}") for i in range(2)]
        restore_ms = []
        for kid, _ in kids:
            t = time.perf_counter()
            await driver.create(kid, driver.image_at(image))
            restore_ms.append(1000 * (time.perf_counter() - t))
        for kid, slot in kids:
            assert await driver.is_running(kid.sandbox_id)
            assert http_get(slot.outer_ip) == 200  # listening socket survived the move
            assert sh(settings, kid.sandbox_id, "cat /root/state").strip() == "before"
        sh(settings, kids[0][0].sandbox_id, "echo child > /root/state")
        assert sh(settings, src.sandbox_id, "cat /root/state").strip() == "before"
        assert sh(settings, kids[1][0].sandbox_id, "cat /root/state").strip() == "before"
        print(f"\ncheckpoint --leave-running {ckpt_ms:.0f} ms; restore {', '.join(f'{m:.0f}' for m in restore_ms)} ms")
    finally:
        shutil.rmtree(image, ignore_errors=True)


async def test_stopping_checkpoint_then_restore_same_id(settings, driver, sandboxes, nm):
    spec, slot = sandboxes(16, "rt-pause")
    await driver.create(spec)
    sh(settings, spec.sandbox_id, "echo kept > /root/state")
    image = settings.data_dir / "images" / "rt-pause"
    shutil.rmtree(image, ignore_errors=True)
    try:
        t = time.perf_counter()
        await driver.checkpoint(spec.sandbox_id, image, leave_running=False)
        pause_ms = 1000 * (time.perf_counter() - t)
        assert spec.sandbox_id not in await driver.list_ids()
        hu.assert_sandbox_gone(settings, spec.sandbox_id, spec.workdir)

        assert nm.allocate(16) == slot  # puts the guest address back on eth0
        t = time.perf_counter()
        await driver.create(spec, driver.image_at(image))
        resume_ms = 1000 * (time.perf_counter() - t)
        assert http_get(slot.outer_ip) == 200
        assert sh(settings, spec.sandbox_id, "cat /root/state").strip() == "kept"
        print(f"\ncheckpoint (stop) {pause_ms:.0f} ms; restore same id {resume_ms:.0f} ms")
    finally:
        shutil.rmtree(image, ignore_errors=True)


@pytest.mark.parametrize("kind", [ocispec.TMP_SIZED, ocispec.TMP_INTERNAL])
async def test_images_of_older_tmp_kinds_restore_with_their_tmp(settings, driver, sandboxes, nm, kind):
    """Sandboxes paused before /tmp moved to the disk (issue 18 item 2) resume with the
    /tmp they had: the image records it (a sized tmpfs, or runsc's own) and restore
    mounts it so again, files included (runsc refuses other mounts); a new sandbox's
    /tmp is a directory of its root filesystem."""
    index = 18 if kind == ocispec.TMP_SIZED else 19
    spec, slot = sandboxes(index, f"rt-tmp-{kind}")
    bundle = ocispec.bundle_dir(spec.workdir)
    await driver._start(spec, "run", ["run", "--detach", f"--bundle={bundle}", spec.sandbox_id], tmp=kind)
    assert sh(settings, spec.sandbox_id, "df --output=target /tmp | tail -1").strip() == "/tmp"
    sh(settings, spec.sandbox_id, "echo kept > /tmp/state")
    image = settings.data_dir / "images" / f"rt-tmp-{kind}"
    shutil.rmtree(image, ignore_errors=True)
    try:
        await driver.checkpoint(spec.sandbox_id, image, leave_running=False)
        assert ocispec.image_tmp(image) == kind
        assert nm.allocate(index) == slot
        await driver.create(spec, driver.image_at(image))
        assert http_get(slot.outer_ip) == 200
        assert sh(settings, spec.sandbox_id, "cat /tmp/state; df --output=target /tmp | tail -1").split() == [
            "kept", "/tmp"]
    finally:
        shutil.rmtree(image, ignore_errors=True)
    new, _ = sandboxes(index + 10, f"rt-tmp-new-{kind}")
    await driver.create(new)
    assert sh(settings, new.sandbox_id, "df --output=target /tmp | tail -1").strip() == "/"


async def test_restore_from_missing_image_fails(settings, driver, sandboxes):
    spec, _ = sandboxes(17, "rt-noimage")
    with pytest.raises(RuntimeError_, match="does not exist"):
        await driver.create(spec, driver.image_at(settings.data_dir / "images" / "nope"))


# --------------------------------------------------------------------------- timing


async def test_create_destroy_timing(settings, driver, sandboxes):
    create_s, ready_s, destroy_s = [], [], []
    for i in range(5):
        spec, slot = sandboxes(20 + i, f"rt-t{i}")
        t = time.perf_counter()
        await driver.create(spec)
        create_s.append(time.perf_counter() - t)
        http_get(slot.outer_ip)
        ready_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        await driver.destroy(spec.sandbox_id, spec.workdir)
        destroy_s.append(time.perf_counter() - t)
        hu.assert_sandbox_gone(settings, spec.sandbox_id, spec.workdir)
    print(f"\ncreate->running {hu.stats_ms(create_s)}; to first HTTP answer {hu.stats_ms(ready_s)}; "
          f"destroy {hu.stats_ms(destroy_s)}")
    assert sorted(destroy_s)[2] < 1.0


@pytest.mark.skipif(not hu.runtime_settings().envd_binary.is_file(), reason="envd binary not built")
async def test_real_envd_answers_health(settings, sandboxes):
    spec, slot = sandboxes(30, "rt-envd")
    await GVisorDriver(settings).create(spec)
    deadline = time.time() + 15
    status = None
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://{slot.outer_ip}:{hu.HTTP_PORT}/health", timeout=2) as r:
                status = r.status
                break
        except Exception:  # noqa: BLE001
            time.sleep(0.02)
    assert status is not None and 200 <= status < 300


async def test_sudo_for_user_goes_through_the_broker(settings, driver, sandboxes):
    """gVisor ignores set-user-ID bits; the driver starts the template's sudo broker next
    to init, and the template's /usr/bin/sudo uses it for non-root users."""
    spec, _ = sandboxes(31, "rt-sudo")
    await driver.create(spec)
    procs = sh(settings, spec.sandbox_id, "ps -eo pid,ppid,args")
    assert any(l.split()[:2] == ["1", "0"] and "http.server" in l for l in procs.splitlines()), procs  # init is PID 1
    deadline = time.time() + 10
    while sh(settings, spec.sandbox_id, "test -S /run/forkyard/sudo.sock && echo up || true").strip() != "up":
        assert time.time() < deadline, "broker did not start"
        time.sleep(0.1)

    assert sh(settings, spec.sandbox_id, "id -un; sudo id -un; sudo -u user id -un", user=USER).split() == [
        "user", "root", "user"]
    assert sh(settings, spec.sandbox_id, "echo piped | sudo cat; cd /tmp && sudo pwd", user=USER).split() == [
        "piped", "/tmp"]
    r = hu.runsc_exec(settings, spec.sandbox_id, ["sudo", "sh", "-c", "exit 7"], user=USER, groups=USER_GROUPS)
    assert r.returncode == 7
    out = sh(settings, spec.sandbox_id,
             "sudo sleep 30 & p=$!; sleep 1; kill -INT $p; wait $p; echo rc=$?; sleep 0.3; pgrep -x sleep | wc -l",
             user=USER).split()
    assert out == ["rc=130", "0"]  # the signal reached the command
    r = hu.runsc_exec(settings, spec.sandbox_id, ["sudo", "id"], user="65534:65534")
    assert r.returncode != 0 and "not allowed" in r.stderr


async def test_without_broker_sudo_says_why(settings, sandboxes):
    spec, _ = sandboxes(32, "rt-nobroker")
    await GVisorDriver(settings, init_argv=hu.HTTP_INIT, sudo_broker=False).create(spec)
    r = hu.runsc_exec(settings, spec.sandbox_id, ["sudo", "id", "-u"], user=USER, groups=USER_GROUPS)
    # Real sudo's own message: "no new privileges" (runsc 20240729) or, since gVisor
    # ignores the setuid bit under no_new_privs, "must be owned by uid 0 and have the
    # setuid bit set" (2026-09 build).
    assert r.returncode != 0 and ("no new privileges" in r.stderr or "setuid bit" in r.stderr), r.stderr
    assert sh(settings, spec.sandbox_id, "sudo id -un").strip() == "root"  # root is unaffected


def _envd_get(ip: str, path: str = "/health", timeout: float = 2.0) -> int:
    with urllib.request.urlopen(f"http://{ip}:{hu.HTTP_PORT}{path}", timeout=timeout) as r:
        return r.status


def _open_envd_connections(ip: str) -> tuple[socket.socket, socket.socket]:
    """An idle keep-alive connection (one request answered, left open) and a streaming
    response in progress (a background command's output), both to envd at ``ip``."""
    idle = socket.create_connection((ip, hu.HTTP_PORT), timeout=5)
    idle.sendall(f"GET /health HTTP/1.1\r\nHost: {ip}\r\n\r\n".encode())
    assert idle.recv(4096).startswith(b"HTTP/1.1 204")
    body = b'{"process":{"cmd":"/bin/sh","args":["-c","while :; do echo tick; sleep 0.1; done"]}}'
    envelope = b"\0" + len(body).to_bytes(4, "big") + body
    stream = socket.create_connection((ip, hu.HTTP_PORT), timeout=5)
    stream.sendall(
        f"POST /process.Process/Start HTTP/1.1\r\nHost: {ip}\r\nContent-Type: application/connect+json\r\n"
        f"Connect-Protocol-Version: 1\r\nContent-Length: {len(envelope)}\r\n\r\n".encode() + envelope)
    got = b""
    while b'"start"' not in got:
        chunk = stream.recv(4096)
        assert chunk, got
        got += chunk
    assert got.startswith(b"HTTP/1.1 200")
    return idle, stream


@pytest.mark.skipif(not hu.runtime_settings().envd_binary.is_file(), reason="envd binary not built")
async def test_fork_with_open_envd_connections_child_answers(settings, sandboxes):
    """Regression: connections open at checkpoint (idle keep-alive, an output stream) are
    reset by runsc (--net-disconnect-ok), and on runsc 20240729 the restored listening
    socket's epoll registration then never fired: the child accepted TCP connections
    but envd never answered (gVisor issue 13920). The driver sent SIGUSR1 after each
    restore so envd re-registered it; the pinned build rebuilds epoll readiness on
    restore (gVisor PR 14147), so the driver no longer does (``FORKYARD_ENVD_REARM=1``
    brings it back) and this test is what shows the restored envd still answers at
    once."""
    envd_driver = GVisorDriver(settings)
    src, src_slot = sandboxes(33, "rt-conn-src")
    kid, kid_slot = sandboxes(34, "rt-conn-kid")
    await envd_driver.create(src)
    deadline = time.time() + 15
    while True:
        try:
            assert _envd_get(src_slot.outer_ip) == 204
            break
        except OSError:
            assert time.time() < deadline, "envd did not come up"
            await asyncio.sleep(0.02)
    idle, stream = _open_envd_connections(src_slot.outer_ip)
    image = settings.data_dir / "images" / "rt-conn-src"
    shutil.rmtree(image, ignore_errors=True)
    try:
        t = time.perf_counter()
        await envd_driver.checkpoint(src.sandbox_id, image, leave_running=True)
        ckpt_ms = 1000 * (time.perf_counter() - t)
        t = time.perf_counter()
        await envd_driver.create(kid, envd_driver.image_at(image))
        restore_ms = 1000 * (time.perf_counter() - t)

        t = time.perf_counter()
        try:
            assert _envd_get(kid_slot.outer_ip, timeout=5) == 204  # hung forever before the fix
        except OSError as exc:
            raise AssertionError(f"restored envd does not answer: {exc!r}") from None
        first_ms = 1000 * (time.perf_counter() - t)
        for _ in range(3):  # fresh connections keep working
            assert _envd_get(kid_slot.outer_ip) == 204
        assert _envd_get(src_slot.outer_ip) == 204  # the source keeps serving

        # The source's open connections: cut by the checkpoint (runsc resets them) or
        # still alive, but never hung.
        stream.settimeout(3)
        try:
            stream.recv(65536)  # EOF, more output, or reset: all fine
        except ConnectionResetError:
            pass
        idle.settimeout(3)
        try:
            idle.sendall(f"GET /health HTTP/1.1\r\nHost: {src_slot.outer_ip}\r\n\r\n".encode())
            answer = idle.recv(4096)
            assert answer == b"" or answer.startswith(b"HTTP/1.1 204"), answer
        except (ConnectionResetError, BrokenPipeError):
            pass
        print(f"\ncheckpoint {ckpt_ms:.0f} ms; restore {restore_ms:.0f} ms; "
              f"child's first answer {first_ms:.0f} ms")
        assert first_ms < 750  # not envd's 1 s fallback poll
    finally:
        idle.close()
        stream.close()
        shutil.rmtree(image, ignore_errors=True)


# --------------------------------------------------------------------------- spare disks


async def test_spare_disks_move_in_and_leave_nothing_behind(settings, sandboxes):
    """A node keeps disks made ahead (``prepare``): a start of that size moves one
    in (its disk is then an ordinary one: a mount at its workdir, destroyed with it), the
    spares are made again, a start of another size makes its own, and a later
    ``prepare`` (a restarted node) or ``shutdown`` removes every spare mount."""
    drv = GVisorDriver(settings, init_argv=hu.HTTP_INIT)
    root = settings.data_dir / "spare-disks"
    leftover = GVisorDriver(settings, init_argv=hu.HTTP_INIT)  # a "crashed" earlier node's spares
    await leftover.prepare(64)

    async def ready(d: GVisorDriver) -> list[str]:
        deadline = time.time() + 30
        while d.spare_disks.wanted() and time.time() < deadline:
            await asyncio.sleep(0.05)
        return d.spare_mounts()

    assert len(await ready(leftover)) == leftover.spare_disks.count > 0
    try:
        await drv.prepare(64)  # removes the leftovers first
        spares = await ready(drv)
        assert len(spares) == drv.spare_disks.count
        assert sorted(line.split()[4] for line in hu.mounts_mentioning(str(root))) == sorted(spares)
        # (ids that are not prefixes of each other: runsc takes a unique prefix for an
        # id, so "rt-spare-o" would be ambiguous beside "rt-spare-other-o")
        spec, slot = sandboxes(35, "rt-spare1", disk_mb=64)
        await drv.create(spec)
        assert http_get(slot.outer_ip) == 200
        overlay = spec.workdir / "overlay"
        assert drv.spare_disks.hits == 1 and (spec.workdir / "disk.img").is_file()
        assert [line.split()[4] for line in hu.mounts_mentioning(str(overlay))] == [str(overlay)]
        used, total = drv.disk_usage(spec.workdir)
        assert 0 < used < total <= gdisk.image_mb(64) << 20
        assert len(await ready(drv)) == drv.spare_disks.count  # made again
        other, other_slot = sandboxes(36, "rt-spare2", disk_mb=80)
        await drv.create(other)
        assert drv.spare_disks.hits == 1  # another size: made in place
        assert gdisk.image_mb(64) << 20 < drv.disk_usage(other.workdir)[1] <= gdisk.image_mb(80) << 20
        await drv.destroy(spec.sandbox_id, spec.workdir)
        assert hu.mounts_mentioning(str(spec.workdir)) == []
    finally:
        await drv.shutdown()
        leftover.spare_disks = None  # its spares were removed by drv's start
    assert hu.mounts_mentioning(str(root)) == [] and not root.exists()
