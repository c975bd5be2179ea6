"""Deploy paths (docs/deploy.md): systemd units, Compose file, Kubernetes manifests, dockerd helper.

What runs by default (about 1 min when the tools are cached):
- the systemd units as ``deploy/install-cluster.sh --root`` installs them, checked with
  ``systemd-analyze verify`` in a private mount namespace where ``/opt/forkyard`` holds this
  checkout's venv and envd, so the units' real paths exist (nothing changes on the host);
- each unit's ExecStart, expanded the way systemd does (Environment=, then the installed
  EnvironmentFile= files, ``%d`` = credentials directory), parsed by the real CLI, and then
  run for real: Redis, scheduler and gateway (the last two as an unprivileged user, as
  DynamicUser= would) and a node form a cluster that the e2b SDK uses through the gateway;
- the Kubernetes manifests rendered with kustomize and validated offline against the
  Kubernetes schemas (``deploy/k8s/validate.sh``), and their command lines parsed by the CLI;
- the Compose file through ``docker-compose config`` and its command lines through the CLI;
- ``deploy/docker/dockerd.sh``: a dockerd started and stopped leaves no chain or bridge.
- ``deploy/compose/smoke.sh``: the Compose cluster end to end (images, 7 containers, the e2b
  SDK creating, pausing, resuming and forking on every node), with a copy of the suite's
  ``base`` template; skipped where docker.io is missing or another dockerd runs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import typer

try:  # typer >= 0.2x vendors click as typer._click; older ones use click itself
    from typer._click.exceptions import UsageError
except ImportError:  # pragma: no cover
    from click import UsageError

from tests.conftest import TEST_ROOT, free_port

REPO = Path(__file__).resolve().parent.parent
UNITS = ["forkyard-node", "forkyard-scheduler", "forkyard-gateway", "forkyard-redis"]
PREFIX = "/opt/forkyard"
from tests._slot import LETTER, SLOT  # noqa: E402 — this session's slot

#: Network names and outer range of the node these tests start (conftest uses 10.220+N,
#: the cluster tests 10.240+N, see tests/_slot.py).
NET_PREFIX = "dp" + LETTER
OUTER_NET = f"10.219.{SLOT * 16}.0/20"


def _cli():
    from forkyard.cli.main import app

    return typer.main.get_command(app)


def cli_accepts(argv: list[str]) -> None:
    """Parse ``forkyard ARGV`` with the real CLI, down to the last subcommand, converting
    every option's value (a ``--help`` run stops at the first eager option and so misses a
    bad value); nothing runs. Raises ``UsageError`` (or a subclass) on drift."""
    cmd = _cli()
    ctx = cmd.make_context("forkyard", list(argv), resilient_parsing=False)
    while hasattr(cmd, "resolve_command"):  # a group: descend into the named subcommand
        protected = ctx.__dict__.get("_protected_args", ctx.__dict__.get("protected_args", []))
        rest = list(protected) + list(ctx.args)
        if not rest:
            break
        name, cmd, rest = cmd.resolve_command(ctx, rest)
        ctx = cmd.make_context(name, rest, parent=ctx)


def test_cli_accepts_detects_drift():
    cli_accepts(["gateway", "--host", "0.0.0.0", "--port", "8080"])
    for bad in (["gateway", "--hots", "x"], ["scheduler", "--port", "nine"], ["nodes"], ["node", "drain"]):
        with pytest.raises(UsageError):
            cli_accepts(bad)


# --------------------------------------------------------------------------- systemd


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """``deploy/install-cluster.sh --root DIR`` (files only): units, env files, secrets."""
    root = tmp_path_factory.mktemp("root")
    subprocess.run(["bash", str(REPO / "deploy/install-cluster.sh"), "--root", str(root)], check=True,
                   capture_output=True)
    return root


def in_installed_ns(argv: list[str], as_user: int | None = None) -> list[str]:
    """``argv`` wrapped to run in a private mount namespace where ``/opt/forkyard/venv`` is
    this checkout's venv and ``/opt/forkyard/bin/envd`` its envd (a tmpfs over /opt; the host
    is unchanged); optionally as uid/gid ``as_user``. The wrapper execs ``argv`` (same pid)."""
    envd = REPO / "envd/bin/envd"
    script = ("mount -t tmpfs forkyard-test-opt /opt && mkdir -p /opt/forkyard/venv /opt/forkyard/bin"
              f" && mount --bind {shlex.quote(str(REPO / '.venv'))} /opt/forkyard/venv"
              f" && {{ [ ! -e {shlex.quote(str(envd))} ] || {{ touch /opt/forkyard/bin/envd"
              f" && mount --bind {shlex.quote(str(envd))} /opt/forkyard/bin/envd; }}; }}"
              ' && exec "$@"')
    user = ["setpriv", f"--reuid={as_user}", f"--regid={as_user}", "--clear-groups"] if as_user is not None else []
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *user, *argv]


def unit_service(path: Path) -> dict[str, list[str]]:
    """The [Service] section of a unit: key → every value given (in order)."""
    out: dict[str, list[str]] = {}
    section = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        if section == "Service":
            k, _, v = line.partition("=")
            out.setdefault(k.strip(), []).append(v.strip())
    return out


def env_file(path: Path) -> dict[str, str]:
    out = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip().strip('"')
    return out


def unit_command(root: Path, unit: str, creds: Path) -> tuple[list[str], dict[str, str]]:
    """The unit's ExecStart as systemd would run it on a host installed under ``root``:
    ``%d`` is ``creds``; Environment= first, then each EnvironmentFile= (from ``root``)
    overriding it; ``${VAR}`` expanded as one word. Returns (argv, environment added)."""
    svc = unit_service(root / f"etc/systemd/system/{unit}.service")
    env: dict[str, str] = {}
    for line in svc.get("Environment", []):
        for item in shlex.split(line.replace("%d", str(creds))):
            k, _, v = item.partition("=")
            env[k] = v
    for f in svc.get("EnvironmentFile", []):
        optional = f.startswith("-")
        p = root / f.lstrip("-").lstrip("/")
        if not p.exists():
            assert optional, f"{unit}: EnvironmentFile {f} is not installed by install-cluster.sh"
            continue
        env.update(env_file(p))
    (exec_start,) = svc["ExecStart"]
    argv = []
    for word in shlex.split(exec_start.replace("%d", str(creds))):
        for var in re.findall(r"\$\{(\w+)\}", word):
            assert env.get(var), f"{unit}: ExecStart uses ${{{var}}}, which is empty or unset"
        argv.append(re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], word))
    return argv, env


def test_units_pass_systemd_analyze_verify(installed):
    units = [installed / f"etc/systemd/system/{u}.service" for u in UNITS]
    r = subprocess.run(in_installed_ns(["systemd-analyze", "verify", *map(str, units)]),
                       capture_output=True, text=True)
    # verify exits 0 on unknown keys or bad values too, so any message is a failure.
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


def test_systemd_analyze_verify_catches_a_broken_unit(installed, tmp_path):
    good = (installed / "etc/systemd/system/forkyard-gateway.service").read_text()
    broken = {"typo.service": good.replace("DynamicUser=", "DynamicUsr="),
              "path.service": good.replace("/opt/forkyard/venv/bin/forkyard", "/opt/forkyard/venv/bin/forkyrd"),
              "value.service": good.replace("Restart=always", "Restart=sometimes")}
    for name, text in broken.items():
        (tmp_path / name).write_text(text)
        r = subprocess.run(in_installed_ns(["systemd-analyze", "verify", str(tmp_path / name)]),
                           capture_output=True, text=True)
        assert r.returncode != 0 or (r.stdout + r.stderr).strip(), name


def test_install_cluster_writes_0600_secrets_and_keeps_edits(installed):
    etc = installed / "etc/forkyard"
    for name in ("cluster_secret", "api_key", "redis-secret.conf", "secrets.env", "node_key"):
        assert (etc / name).stat().st_mode & 0o777 == 0o600, name
    assert len((etc / "cluster_secret").read_text().strip()) >= 32
    assert re.fullmatch(r"e2b_[0-9a-f]{40}", (etc / "api_key").read_text().strip())
    # The node's own key (bound to this host's name and default URL), never the secret itself.
    from forkyard.cluster.nodekeys import node_key

    assert (etc / "node_key").read_text().strip() == node_key((etc / "cluster_secret").read_text().strip(),
                                                             socket.gethostname(), "http://127.0.0.1:3000")
    # The Redis password is only in redis-secret.conf (scheduler and gateway read it from
    # there), not in the secrets.env every node also reads.
    pw = (etc / "redis-secret.conf").read_text().split()[1]
    assert env_file(etc / "secrets.env")["FORKYARD_REDIS_URL"] == "redis://127.0.0.1:6379/0"
    assert pw not in (etc / "secrets.env").read_text()
    redis_conf = (etc / "redis.conf").read_text()
    assert re.search(r"^appendonly yes$", redis_conf, re.M) and re.search(r"^appendfsync everysec$", redis_conf, re.M)
    # A second run keeps what the operator edited and the secrets already shared.
    (etc / "node.env").write_text("FORKYARD_PORT=3999\n")
    secret = (etc / "cluster_secret").read_text()
    subprocess.run(["bash", str(REPO / "deploy/install-cluster.sh"), "--root", str(installed)], check=True,
                   capture_output=True)
    assert (etc / "node.env").read_text() == "FORKYARD_PORT=3999\n"
    assert (etc / "cluster_secret").read_text() == secret
    (etc / "node.env").write_text((REPO / "deploy/systemd/etc/node.env").read_text())


def test_unit_command_lines_are_accepted_by_the_cli(installed, tmp_path):
    for unit in UNITS[:3]:
        argv, _ = unit_command(installed, unit, tmp_path)
        assert argv[0] == f"{PREFIX}/venv/bin/forkyard", argv
        cli_accepts(argv[1:])
        r = subprocess.run(in_installed_ns(argv + ["--help"]), capture_output=True, text=True)
        assert r.returncode == 0, (unit, r.stdout + r.stderr)
    argv, _ = unit_command(installed, "forkyard-redis", tmp_path)
    assert argv[:2] == ["/usr/bin/redis-server", "/etc/forkyard/redis.conf"], argv


@pytest.fixture
def unit_cluster(installed, tmp_path, base_template):
    """The four units' command lines, run as systemd would run them, on a host configured
    the way docs/deploy.md says (the installed env files edited for free ports, a data dir
    and network names of this test). Yields (gateway URL, scheduler URL, api key, secret)."""
    from tests._cluster import Proc, _wipe_node

    if not shutil.which("redis-server"):
        pytest.fail("redis-server is missing: deploy/install.sh installs it (apt-get install redis-server)")
    root = tmp_path / "root"
    shutil.copytree(installed, root)
    etc = root / "etc/forkyard"
    data = TEST_ROOT / f"deploy-{NET_PREFIX}"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    ports = {k: free_port() for k in ("redis", "scheduler", "gateway", "node")}
    # What an operator edits (docs/deploy.md): ports, data dir, repository, templates.
    with open(etc / "cluster.env", "a") as f:
        f.write(f"FORKYARD_SCHEDULER_URL=http://127.0.0.1:{ports['scheduler']}\n"
                f"FORKYARD_REPO={data / 'repo'}\n")
    with open(etc / "node.env", "a") as f:
        f.write(f"FORKYARD_PORT={ports['node']}\nFORKYARD_DATA_DIR={data / 'node'}\n"
                f"FORKYARD_TEMPLATES_DIR={base_template.parent.parent}\nFORKYARD_NODE_ID=unit-node\n"
                f"FORKYARD_NET_PREFIX={NET_PREFIX}\nFORKYARD_OUTER_NET={OUTER_NET}\n")
    (etc / "scheduler.env").write_text(f"FORKYARD_SCHEDULER_PORT={ports['scheduler']}\n")
    (etc / "gateway.env").write_text(f"FORKYARD_GATEWAY_HOST=127.0.0.1\nFORKYARD_GATEWAY_PORT={ports['gateway']}\n")
    secrets_env = (etc / "secrets.env").read_text().replace("127.0.0.1:6379", f"127.0.0.1:{ports['redis']}")
    (etc / "secrets.env").write_text(secrets_env)
    # The node's id and URL changed: its key is minted again, as docs/deploy.md says.
    subprocess.run([str(REPO / ".venv/bin/forkyard"), "cluster", "node-key", "unit-node",
                    "--url", f"http://127.0.0.1:{ports['node']}", "--out", str(etc / "node_key")],
                   env=dict(os.environ, FORKYARD_CLUSTER_SECRET_FILE=str(etc / "cluster_secret")),
                   check=True, capture_output=True)
    # LoadCredential=: a private copy of each secret, 0400, owned by the service's user.
    # DynamicUser= runs scheduler and gateway unprivileged. The venv's interpreter must then
    # be readable by that user: install-cluster.sh builds /opt/forkyard/venv on
    # /usr/bin/python3; a checkout's .venv on an interpreter under /root (pyenv) is not, and
    # then they run as root here.
    nobody = 65534
    probe = subprocess.run(["setpriv", f"--reuid={nobody}", f"--regid={nobody}", "--clear-groups",
                            str(REPO / ".venv/bin/python"), "-c", "import forkyard.cluster.store"],
                           capture_output=True, cwd="/")
    if probe.returncode != 0:
        nobody = None
    creds = {}
    for who, uid in (("root", 0), ("nobody", nobody or 0)):
        d = tmp_path / f"creds-{who}"
        d.mkdir()
        os.chmod(d, 0o500)
        for name, src in (("cluster_secret", "cluster_secret"), ("api_key", "api_key"),
                          ("redis_secret.conf", "redis-secret.conf"), ("node_key", "node_key")):
            shutil.copy(etc / src, d / name)
            os.chmod(d / name, 0o400)
            os.chown(d / name, uid, uid)
        os.chown(d, uid, uid)
        creds[who] = d
    os.chmod(tmp_path, 0o755)

    def etc_paths(argv: list[str]) -> list[str]:  # /etc/forkyard/X → the installed copy
        return [a.replace("/etc/forkyard/", f"{etc}/") for a in argv]

    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "FORKYARD_"))}
    procs = []
    (data / "redis").mkdir()
    argv, env = unit_command(root, "forkyard-redis", creds["root"])
    # StateDirectory=forkyard-redis is the `dir` of redis.conf; systemd creates it. Here the
    # installed redis.conf gets this test's directory instead, and a free port.
    assert unit_service(root / "etc/systemd/system/forkyard-redis.service")["StateDirectory"] == ["forkyard-redis"]
    conf = (etc / "redis.conf").read_text()
    assert "\ndir /var/lib/forkyard-redis\n" in conf and "\nport 6379\n" in conf
    (etc / "redis.conf").write_text(conf.replace("dir /var/lib/forkyard-redis", f"dir {data / 'redis'}")
                                    .replace("port 6379", f"port {ports['redis']}"))
    redis = Proc("redis", etc_paths(argv), dict(base_env, **env), data / "redis.log", None)
    specs = [("scheduler", nobody, f"http://127.0.0.1:{ports['scheduler']}/health"),
             ("gateway", nobody, f"http://127.0.0.1:{ports['gateway']}/health"),
             ("node", None, f"http://127.0.0.1:{ports['node']}/health")]
    try:
        redis.start()
        procs.append(redis)
        import redis as redis_client

        from forkyard.cluster.config import redis_url

        url = redis_url({"FORKYARD_REDIS_URL": env_file(etc / "secrets.env")["FORKYARD_REDIS_URL"],
                         "FORKYARD_REDIS_PASSWORD_FILE": str(etc / "redis-secret.conf")})
        deadline = time.time() + 20
        while True:
            try:
                assert redis_client.Redis.from_url(url).config_get("appendonly") == {"appendonly": "yes"}
                break
            except redis_client.RedisError:
                assert redis.running() and time.time() < deadline, (data / "redis.log").read_text()[-2000:]
                time.sleep(0.1)
        for role, uid, health in specs:
            argv, env = unit_command(root, f"forkyard-{role}", creds["nobody" if uid else "root"])
            p = Proc(role, in_installed_ns(argv, as_user=uid), dict(base_env, **env), data / f"{role}.log", health)
            p.start(wait_s=180)
            procs.append(p)
        yield (f"http://127.0.0.1:{ports['gateway']}", f"http://127.0.0.1:{ports['scheduler']}",
               (etc / "api_key").read_text().strip(), (etc / "cluster_secret").read_text().strip())
    finally:
        for p in reversed(procs):
            p.stop()
        _wipe_node(data / "node", NET_PREFIX, OUTER_NET)
        for log in data.glob("*.log"):  # kept with pytest's tmp_path for a failed run
            shutil.copy(log, tmp_path / log.name)
        shutil.rmtree(data, ignore_errors=True)
        assert not [l for l in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
                    if re.match(rf"^{NET_PREFIX}\d+s? ?", l)]
        assert f"FORKYARD-{NET_PREFIX.upper()}-" not in subprocess.run(["iptables-save"], capture_output=True,
                                                                        text=True).stdout


def test_unit_command_lines_form_a_cluster(unit_cluster):
    from e2b import Sandbox

    gateway, scheduler, api_key, secret = unit_cluster
    deadline = time.time() + 30
    while True:
        nodes = httpx.get(f"{scheduler}/v1/nodes", headers={"x-forkyard-cluster-secret": secret}, timeout=10).json()
        if [n["status"] for n in nodes if n["nodeID"] == "unit-node"] == ["up"]:
            break
        assert time.time() < deadline, nodes
        time.sleep(0.2)
    sbx = Sandbox.create("base", api_key=api_key, api_url=gateway, sandbox_url=gateway, timeout=60)
    try:
        assert sbx.commands.run("echo $((6*7))").stdout.strip() == "42"
    finally:
        sbx.kill()
    assert httpx.get(f"{gateway}/v2/sandboxes", headers={"X-API-Key": "e2b_" + "0" * 40}).status_code == 401


# --------------------------------------------------------------------------- Kubernetes


@pytest.fixture(scope="module")
def k8s_rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """deploy/k8s/validate.sh: kustomize build of base and overlays + offline strict schema
    validation. Returns {build name: objects}."""
    import yaml

    tools = subprocess.run(["bash", str(REPO / "deploy/k8s/tools.sh")], capture_output=True, text=True)
    if tools.returncode != 0:
        pytest.skip(f"kustomize / kubernetes-validate could not be installed (Go proxy or PyPI "
                    f"unreachable?): {tools.stderr[-500:]}")
    out = tmp_path_factory.mktemp("k8s")
    r = subprocess.run(["bash", str(REPO / "deploy/k8s/validate.sh"), str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no network" in r.stdout, r.stdout  # the schemas came from the package
    return {p.stem: [d for d in yaml.safe_load_all(p.read_text()) if d] for p in out.glob("*.yaml")}


def test_k8s_validation_rejects_a_broken_manifest(k8s_rendered, tmp_path):
    import yaml

    tools = Path(subprocess.run(["bash", str(REPO / "deploy/k8s/tools.sh")], capture_output=True, text=True,
                                check=True).stdout.strip())
    ds = next(d for d in k8s_rendered["base"] if d["kind"] == "DaemonSet")
    broken = json.loads(json.dumps(ds))
    broken["spec"]["template"]["spec"]["hostNetwrk"] = True
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(broken))
    r = subprocess.run([str(tools / "venv/bin/kubernetes-validate"), "--strict", "--quiet", str(tmp_path / "broken.yaml")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "hostNetwrk" in r.stdout + r.stderr


def _k8s_args(container: dict, config: dict[str, str], fake: dict[str, str]) -> list[str]:
    """A container's args with Kubernetes' $(VAR) expansion from its env and the ConfigMap."""
    env = dict(config)
    for e in container.get("env", []):
        env[e["name"]] = fake.get(e["name"], e.get("value", "x"))
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]


def test_k8s_objects_and_command_lines(k8s_rendered):
    for build, objs in k8s_rendered.items():
        by = {(o["kind"], o["metadata"]["name"]): o for o in objs}
        assert all(o["metadata"].get("namespace") == "forkyard" for o in objs if o["kind"] != "Namespace"), build
        config = by[("ConfigMap", "forkyard-config")]["data"]
        secret = by[("Secret", "forkyard-secrets")]
        assert all("CHANGE-ME" in v for v in secret["stringData"].values()), "placeholders only, never real secrets"
        ds = by[("DaemonSet", "forkyard-node")]["spec"]["template"]["spec"]
        (node,) = ds["containers"]
        sc = node["securityContext"]
        # privileged: the only way a pod reaches the host's loop devices (sandbox disks)
        assert ds["hostNetwork"] is True and sc.get("privileged") is True
        assert sc["capabilities"] == {"add": ["ALL"], "drop": ["SYS_RESOURCE"]}
        assert sc["seccompProfile"]["type"] == sc["appArmorProfile"]["type"] == "Unconfined"
        host_paths = {v["hostPath"]["path"] for v in ds["volumes"] if "hostPath" in v}
        assert host_paths == {"/var/lib/forkyard", "/sys/fs/cgroup", "/etc/forkyard/node_key"}
        # a node holds its own key only (a host file), never the cluster secret or Redis's password
        env = {e["name"]: e for e in node["env"]}
        assert env["FORKYARD_NODE_KEY_FILE"]["value"] == "/etc/forkyard/node_key"
        assert not {"FORKYARD_CLUSTER_SECRET", "FORKYARD_CLUSTER_SECRET_FILE", "FORKYARD_REDIS_URL"} & set(env)
        (items,) = [v["secret"]["items"] for v in ds["volumes"] if "secret" in v]
        assert [i["key"] for i in items] == ["api_key"]
        redis = by[("StatefulSet", "forkyard-redis")]["spec"]["template"]["spec"]["containers"][0]
        script = " ".join(redis["args"])
        assert "--appendonly yes" in script and "umask 077" in script and "mkdir -m 700 /data/redis" in script
        assert "requirepass" in script and "$(REDIS_PASSWORD)" not in script  # on stdin, not in argv
        policy = by[("NetworkPolicy", "forkyard-redis")]["spec"]
        assert {p["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for p in policy["ingress"][0]["from"]} \
            == {"forkyard-scheduler", "forkyard-gateway"}
        for kind, name in (("DaemonSet", "forkyard-node"), ("Deployment", "forkyard-scheduler"),
                           ("Deployment", "forkyard-gateway")):
            (c,) = by[(kind, name)]["spec"]["template"]["spec"]["containers"]
            argv = _k8s_args(c, config, {"HOST_IP": "10.0.0.5"})
            cli_accepts(argv)
            port = int(argv[argv.index("--port") + 1])
            assert c["readinessProbe"]["httpGet"]["path"] == "/health"
            assert c["readinessProbe"]["httpGet"]["port"] in (port, "http")
            assert {p["containerPort"] for p in c["ports"]} == {port}
        svc_ports = {n: by[("Service", n)]["spec"]["ports"][0]["port"]
                     for n in ("forkyard-scheduler", "forkyard-gateway")}
        assert svc_ports == {"forkyard-scheduler": 9090, "forkyard-gateway": 8080}
        assert config["FORKYARD_SCHEDULER_URL"] == "http://forkyard-scheduler:9090"


# --------------------------------------------------------------------------- Compose


def _docker_compose() -> str:
    exe = shutil.which("docker-compose")
    if exe is None:
        r = subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "docker-compose"],
                           capture_output=True, text=True, env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
        exe = shutil.which("docker-compose")
        if exe is None:
            pytest.skip(f"docker-compose is not installed and apt-get could not install it: {r.stderr[-300:]}")
    return exe


def test_compose_file_is_valid_and_its_command_lines_parse(tmp_path):
    import yaml

    compose = _docker_compose()
    secrets = tmp_path / "secrets"
    subprocess.run(["bash", str(REPO / "deploy/compose/make-secrets.sh"), str(secrets)], check=True)
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in secrets.iterdir())
    env = dict(os.environ, FORKYARD_SECRETS=str(secrets), FORKYARD_DNS="192.0.2.53")
    f = str(REPO / "deploy/compose/docker-compose.yml")
    r = subprocess.run([compose, "-f", f, "config"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    services = cfg["services"]
    assert set(services) == {"redis", "s3", "scheduler", "gateway", "node1", "node2", "node3"}
    for name in ("scheduler", "gateway", "node1", "node2", "node3"):
        cli_accepts(services[name]["command"])
    for name in ("node1", "node2", "node3"):
        s = services[name]
        assert s["cap_add"] == ["ALL"] and s["cap_drop"] == ["SYS_RESOURCE"] and not s.get("privileged")
        assert s["environment"]["FORKYARD_ADVERTISE_URL"] == f"http://{name}:3000"
        # a node holds its own key only: not the cluster secret, not the Redis password
        assert s["environment"]["FORKYARD_NODE_KEY_FILE"] == f"/run/secrets/{name}_key"
        assert "FORKYARD_CLUSTER_SECRET_FILE" not in s["environment"] and "FORKYARD_REDIS_URL" not in s["environment"]
        assert {x["source"] for x in s["secrets"]} == {f"{name}_key", "api_key"}
        assert s["environment"]["FORKYARD_REPO"].startswith("s3://")
        # sandbox disks are loop mounts: loop-control and loop block devices; a resolver
        assert s["devices"] == ["/dev/loop-control"] and s["device_cgroup_rules"] == ["b 7:* rmw"]
        assert s["dns"] == ["192.0.2.53"]
    redis_cmd = " ".join(services["redis"]["command"])
    assert "--appendonly yes" in redis_cmd and "umask 077" in redis_cmd and "ports" not in services["redis"]
    # Without the secrets directory the file refuses to render.
    r = subprocess.run([compose, "-f", f, "config", "-q"], capture_output=True, text=True,
                       env={k: v for k, v in env.items() if k != "FORKYARD_SECRETS"})
    assert r.returncode != 0 and "FORKYARD_SECRETS" in r.stderr


# --------------------------------------------------------------------------- Docker


def _docker_chains() -> list[str]:
    out = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
    return [l for l in out.splitlines() if re.search(r"DOCKER|docker0|br-[0-9a-f]{12}", l)]


@pytest.mark.skipif(not shutil.which("dockerd"), reason="docker.io is not installed (apt-get install docker.io)")
def test_dockerd_helper_leaves_the_host_as_it_found_it():
    if subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        pytest.skip("a dockerd is already running; the helper would not own it")
    policy = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True).stdout.splitlines()[0]
    helper = str(REPO / "deploy/docker/dockerd.sh")
    try:
        subprocess.run(["bash", helper, "start"], check=True, capture_output=True, timeout=90)
        assert _docker_chains(), "dockerd added no chains: the check below would prove nothing"
        # --pull=never: no registry is reachable here; an image not built yet is fine.
        r = subprocess.run(["docker", "run", "--rm", "--pull=never", "--network", "none", "forkyard/bookworm:local",
                            "true"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 or "No such image" in r.stderr, r.stderr
    finally:
        subprocess.run(["bash", helper, "stop"], check=True, capture_output=True, timeout=90)
    assert subprocess.run(["pgrep", "-x", "dockerd"], capture_output=True).returncode == 1
    assert _docker_chains() == []
    assert subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True).stdout.splitlines()[0] == policy
    assert "docker0" not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


@pytest.mark.skipif(not shutil.which("dockerd"), reason="docker.io is not installed (apt-get install docker.io)")
@pytest.mark.timeout(2400)
def test_compose_cluster_creates_pauses_resumes_and_forks_on_every_node(base_template):
    """deploy/compose/smoke.sh end to end: images built without a registry, redis, s3,
    scheduler, gateway and 3 node containers (loop devices, a resolver), then the e2b
    SDK creates, pauses, resumes and forks on every node (before, every create was a
    500: the node containers had no loop devices). The nodes get a copy of the suite's
    `base` template; building it inside a node container (~5-10 min here) is what
    `FORKYARD_SMOKE_TEMPLATES=volume deploy/compose/smoke.sh` does."""
    from conftest import TEST_ROOT

    if subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        pytest.skip("a dockerd is already running here (another session's); smoke.sh would share it")
    templates = TEST_ROOT / f"compose-templates-{os.getpid()}"
    shutil.rmtree(templates, ignore_errors=True)
    templates.mkdir(parents=True)
    try:
        # hard links: the nodes only read it (a copy of 900 MB took minutes on a busy disk)
        src = str(base_template.parent)  # .../base (its rootfs inside)
        if subprocess.run(["cp", "-al", src, str(templates / "base")], capture_output=True).returncode != 0:
            # the shared template cache may be a filesystem of its own: no hard links across
            shutil.rmtree(templates / "base", ignore_errors=True)
            subprocess.run(["cp", "-a", src, str(templates / "base")], check=True)
        r = subprocess.run(["bash", str(REPO / "deploy/compose/smoke.sh")], capture_output=True, text=True,
                           env=dict(os.environ, PYTHON=sys.executable, FORKYARD_SMOKE_TEMPLATES=str(templates)))
    finally:
        shutil.rmtree(templates, ignore_errors=True)
    print(r.stderr[-3000:])  # the phases and their times
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    assert "smoke flow ok on 3 nodes" in r.stdout
    for node in ("node1", "node2", "node3"):
        assert f"[{node}] fork:" in r.stdout
    assert _docker_chains() == []
