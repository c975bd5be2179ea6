"""A real S3 server for the tests: MinIO, with real SigV4 authentication and a region.

The binary is ``$FORKYARD_MINIO``, else ``$FORKYARD_TEST_DATA_DIR/bin/minio``;
``deploy/test.sh`` builds it there once from the Go module proxy (pinned version
:data:`MINIO_MODULE`). Each :class:`MinIO` is its own process on a free loopback port with
its own data directory, removed by :meth:`MinIO.stop` — or, given ``netns``, inside that
network namespace on ``host:port`` (bench/bench_p2p.py: a repository behind a shaped link).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

MINIO_MODULE = "github.com/minio/minio@v0.0.0-20260212201848-7aac2a2c5b7c"
REGION = "eu-central-1"  # not the default us-east-1, so a region mix-up shows


def minio_binary() -> Path:
    """Path of the MinIO binary.

    Raises:
        RuntimeError: not built (the message says how).
    """
    root = Path(os.environ.get("FORKYARD_TEST_DATA_DIR", "/var/lib/forkyard-test"))
    path = Path(os.environ.get("FORKYARD_MINIO", root / "bin" / "minio"))
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"MinIO not found at {path}: run deploy/test.sh once, or "
                           f"CGO_ENABLED=0 GOBIN={path.parent} go install {MINIO_MODULE}")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MinIO:
    """One MinIO server process.

    Attributes:
        url: endpoint URL (``http://127.0.0.1:PORT``).
        access_key, secret_key: its root credentials (default: a fresh random secret).
        region: its site region (:data:`REGION`); requests signed for another fail.
    """

    def __init__(self, access_key: str = "forkyard-test", secret_key: str | None = None,
                 netns: str | None = None, host: str = "127.0.0.1", port: int | None = None):
        self.netns, self.host = netns, host  # netns: run it inside that network namespace, listening on host
        self.access_key = access_key
        self.secret_key = secret_key or secrets.token_hex(16)
        self.region = REGION
        self.dir = Path(tempfile.mkdtemp(prefix="forkyard-minio-"))
        self.port = port or _free_port()
        self.url = f"http://{host}:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60) -> MinIO:
        """Start it and wait until it answers its health endpoint.

        Raises:
            RuntimeError: it exited or did not answer in ``timeout_s``.
        """
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(self.dir), "MINIO_ROOT_USER": self.access_key,
               "MINIO_ROOT_PASSWORD": self.secret_key, "MINIO_SITE_REGION": self.region,
               "MINIO_BROWSER": "off", "MINIO_UPDATE": "off"}
        log = open(self.dir / "minio.log", "wb")
        inns = ["ip", "netns", "exec", self.netns] if self.netns else []
        self.proc = subprocess.Popen(
            inns + [str(minio_binary()), "server", str(self.dir / "data"), "--address", f"{self.host}:{self.port}",
                    "--console-address", f"{self.host}:{self.port + 1 if self.netns else _free_port()}", "--quiet"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.time() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"minio exited with {self.proc.returncode}: "
                                   f"{(self.dir / 'minio.log').read_text()[-2000:]}")
            try:
                urllib.request.urlopen(self.url + "/minio/health/ready", timeout=2).read()
                return self
            except OSError:
                if time.time() > deadline:
                    self.stop()
                    raise RuntimeError(f"minio did not answer in {timeout_s} s")
                time.sleep(0.2)

    def client(self, **overrides):
        """A boto3 S3 client with this server's credentials (``overrides``: any of
        ``region_name``, ``aws_access_key_id``, ``aws_secret_access_key``)."""
        import boto3
        from botocore.config import Config

        kw = {"region_name": self.region, "aws_access_key_id": self.access_key,
              "aws_secret_access_key": self.secret_key, **overrides}
        return boto3.client("s3", endpoint_url=self.url, config=Config(s3={"addressing_style": "path"}), **kw)

    def make_bucket(self, name: str) -> None:
        """Create bucket ``name`` in :attr:`region`."""
        self.client().create_bucket(Bucket=name, CreateBucketConfiguration={"LocationConstraint": self.region})

    def kill(self) -> None:
        """SIGKILL the server (the repository "goes away"); data stays until :meth:`stop`."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        """Stop the server and remove its data."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)
