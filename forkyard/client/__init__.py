"""Typed asyncio client for forkyard, for RL loops and scripts.

REST calls go through :class:`AsyncForkyard` (httpx); work inside a sandbox goes through
the official e2b SDK's ``AsyncSandbox`` it hands out. ::

    from forkyard.client import AsyncForkyard, rollout

    async with AsyncForkyard() as fy:            # URL/key: env or `forkyard auth`
        src = await fy.create("base", timeout=600)
        await src.commands.run("pip install -q numpy")
        results = await rollout(src, 16, "python3 episode.py", concurrency=8,
                                collect_files=["/home/user/reward.txt"], client=fy)
        for r in results:
            print(r.index, r.exit_code, r.error, r.files.get("/home/user/reward.txt"))
        await fy.kill(src.sandbox_id)
"""

from forkyard.client.api import (
    AsyncForkyard,
    SandboxInfo,
    SnapshotInfo,
    TemplateInfo,
)
from forkyard.client.config import (
    ResolvedConfig,
    config_path,
    resolve,
    write_config_file,
)
from forkyard.client.errors import (
    ApiError,
    AuthError,
    BadRequest,
    Conflict,
    ForkError,
    ForkyardError,
    NotFound,
    NotSupported,
    ServerUnreachable,
)
from forkyard.client.fanout import ChildResult, Step
from forkyard.client.rollout import fork, rollout

__all__ = [
    "ApiError",
    "AsyncForkyard",
    "AuthError",
    "BadRequest",
    "ChildResult",
    "Conflict",
    "ForkError",
    "ForkyardError",
    "NotFound",
    "NotSupported",
    "ResolvedConfig",
    "SandboxInfo",
    "ServerUnreachable",
    "SnapshotInfo",
    "Step",
    "TemplateInfo",
    "config_path",
    "fork",
    "resolve",
    "rollout",
    "write_config_file",
]
