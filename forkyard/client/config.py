"""Where the client finds the server URL and API key.

Order (first wins): explicit arguments; environment (``FORKYARD_URL`` or ``E2B_API_URL``;
``E2B_API_KEY`` or ``FORKYARD_API_KEY``); the config file written by ``forkyard auth``
(``$FORKYARD_CONFIG``, else ``$XDG_CONFIG_HOME/forkyard/config.toml``, else
``~/.config/forkyard/config.toml``, mode 0600); finally the local defaults
``http://127.0.0.1:$FORKYARD_PORT`` (3000; the same setting the server reads) and the key
file of a server on this host
(``$FORKYARD_DATA_DIR/api_key``, default ``/var/lib/forkyard/api_key``) when readable.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from forkyard.config import ClientSettings

DEFAULT_URL = "http://127.0.0.1:3000"


def config_path() -> Path:
    """Path of the CLI config file (it need not exist)."""
    env = ClientSettings()
    if env.config_file:
        return Path(env.config_file).expanduser()
    base = env.xdg_config_home or str(Path.home() / ".config")
    return Path(base).expanduser() / "forkyard" / "config.toml"


def read_config_file(path: Path | None = None) -> dict[str, str]:
    """The ``[server]`` table of the config file as ``{"url": …, "api_key": …}``; ``{}``
    when the file is missing. Raises ``ValueError`` when it is not valid TOML."""
    path = path or config_path()
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from e
    server = data.get("server", {})
    return {k: str(v) for k, v in server.items() if k in ("url", "api_key") and v}


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_config_file(url: str, api_key: str, path: Path | None = None) -> Path:
    """Write URL and key to the config file, created with mode 0600 (its directory 0700).
    Returns the path. Raises ``OSError`` when it cannot be written."""
    path = path or config_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("# written by `forkyard auth`\n[server]\n")
        f.write(f"url = {_toml_str(url)}\napi_key = {_toml_str(api_key)}\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path


@dataclass
class ResolvedConfig:
    """Server URL and API key plus where each came from (for messages)."""

    url: str
    api_key: str | None
    url_source: str
    key_source: str

    @property
    def sandbox_url(self) -> str:
        """URL for envd traffic: ``E2B_SANDBOX_URL`` or the API URL (the forkyard proxy)."""
        return ClientSettings().sandbox_url or self.url


def _local_key_file() -> Path:
    return Path(ClientSettings().data_dir) / "api_key"


def resolve(url: str | None = None, api_key: str | None = None) -> ResolvedConfig:
    """Resolve URL and key (see the module docstring for the order). The key may be
    ``None`` when nothing provides one; the server then answers 401."""
    env = ClientSettings()
    try:
        fileconf = read_config_file()
    except ValueError:
        fileconf = {}
    if url:
        url_src = "argument"
    elif env.url:
        url, url_src = env.url, "FORKYARD_URL"
    elif env.e2b_api_url:
        url, url_src = env.e2b_api_url, "E2B_API_URL"
    elif fileconf.get("url"):
        url, url_src = fileconf["url"], str(config_path())
    elif env.port.isdigit():
        url, url_src = f"http://127.0.0.1:{env.port}", "FORKYARD_PORT"
    else:
        url, url_src = DEFAULT_URL, "default"
    if api_key:
        key_src = "argument"
    elif env.e2b_api_key:
        api_key, key_src = env.e2b_api_key, "E2B_API_KEY"
    elif env.api_key:
        api_key, key_src = env.api_key, "FORKYARD_API_KEY"
    elif fileconf.get("api_key"):
        api_key, key_src = fileconf["api_key"], str(config_path())
    else:
        key_src = "none"
        try:
            api_key = _local_key_file().read_text().strip() or None
            if api_key:
                key_src = str(_local_key_file())
        except OSError:
            api_key = None
    return ResolvedConfig(url=url.rstrip("/"), api_key=api_key, url_source=url_src, key_source=key_src)
