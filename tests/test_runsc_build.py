"""The node's runsc build (deploy/runsc/build.sh): sandboxes install the seccomp filters
that patch 0030 precompiled into it, at a fresh start and at a restore, instead of
compiling and optimizing them at every start (~25 ms of CPU in the sentry and ~8 ms in
the gofer per sandbox; docs/runtime.md)."""

from __future__ import annotations

import shutil

from e2b import Sandbox

LOADED = "Loaded precompiled seccomp instructions"
MISSING = "No precompiled program found"


def test_sandboxes_install_precompiled_seccomp_filters(server):
    server.kill_all()
    logs = server.data_dir / "runsc-debug"
    shutil.rmtree(logs, ignore_errors=True)
    with server.restarted_with(FORKYARD_RUNSC_DEBUG="1"), server.api() as c:
        src = Sandbox.create("base", timeout=120)
        assert src.commands.run("echo started").stdout.strip() == "started"
        r = c.post(f"/sandboxes/{src.sandbox_id}/fork", json={"count": 1, "timeout": 120})  # a restore
        assert r.status_code == 201 and "sandbox" in r.json()[0], r.text
        kid = Sandbox.connect(r.json()[0]["sandbox"]["sandboxID"])
        assert kid.commands.run("echo restored").stdout.strip() == "restored"
        boot = {p.name: p.read_text(errors="replace") for p in logs.glob("*.boot.txt")}
        gofer = {p.name: p.read_text(errors="replace") for p in logs.glob("*.gofer.txt")}
        server.kill_all()
    assert len(boot) >= 2 and len(gofer) >= 2, (sorted(boot), sorted(gofer))  # the source's and the child's
    for name, text in {**boot, **gofer}.items():
        assert MISSING not in text, f"{name}: {text[text.index(MISSING):][:300]}"
        assert LOADED in text, name
    shutil.rmtree(logs, ignore_errors=True)
