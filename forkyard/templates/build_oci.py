"""Import a container image (local OCI image layout or ``docker save`` tarball) as a
rootfs template — no registry access needed.

Layers are applied in order into ``<templates_dir>/<name>/.rootfs.partial`` with OCI
whiteout semantics (``.wh.NAME`` deletes ``NAME`` of lower layers, ``.wh..wh..opq``
empties its directory of lower-layer entries), every path resolved inside the rootfs
(symlinks in the image never lead outside it), device nodes skipped. The result is
renamed to ``rootfs``, made read-only like ``base`` and marked complete with the
``.complete`` marker :mod:`forkyard.templates.registry` expects (content starts with
``imported``). What the runtime needs is added when missing: mount points for envd
(``/usr/local/bin/envd``), ``/etc/hosts``, ``/etc/hostname``; ``/etc/passwd`` and
``/etc/group`` with root; ``/tmp``; ``/etc/resolv.conf`` from the host.

envd (injected by the runtime) runs commands as root when the image has no ``user``
account; the SDK's ``commands.run`` needs ``/bin/bash`` in the image.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import posixpath
import shutil
import stat
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from forkyard.config import Settings
from forkyard.ids import is_name
from forkyard.templates import base as base_tmpl
from forkyard.templates import registry

Progress = Callable[[str], None]
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"


class ImageImportError(Exception):
    """The image could not be imported (bad layout, unsupported layer, bad name)."""


class TemplateExists(ImageImportError):
    """A template of that name already exists."""


# ------------------------------------------------------------------ reading the image
class _Source:
    """Uniform read access to an OCI layout directory or a tar archive of one / of
    ``docker save`` output."""

    def __init__(self, path: Path):
        self.path = path
        self.tar: tarfile.TarFile | None = None
        if path.is_dir():
            return
        try:
            self.tar = tarfile.open(path, "r:*")
            self.names = {posixpath.normpath(m.name): m for m in self.tar.getmembers()}
        except (tarfile.TarError, OSError, EOFError) as e:
            raise ImageImportError(f"{path} is neither a directory nor a readable tar archive: {e}") from e

    def exists(self, name: str) -> bool:
        if self.tar is None:
            return (self.path / name).is_file()
        return posixpath.normpath(name) in self.names

    def open(self, name: str) -> IO[bytes]:
        name = posixpath.normpath(name)
        if name.startswith(("/", "..")):
            raise ImageImportError(f"unsafe path {name!r} in image")
        if self.tar is None:
            try:
                return open(self.path / name, "rb")
            except OSError as e:
                raise ImageImportError(f"missing {name} in {self.path}: {e}") from e
        m = self.names.get(name)
        f = self.tar.extractfile(m) if m is not None else None
        if f is None:
            raise ImageImportError(f"missing {name} in {self.path}")
        return f

    def json(self, name: str):
        try:
            with self.open(name) as f:
                return json.load(f)
        except ValueError as e:
            raise ImageImportError(f"{name} is not valid JSON: {e}") from e

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()


def _blob(digest: str) -> str:
    alg, _, hexpart = str(digest).partition(":")
    if not alg or not hexpart or "/" in digest or ".." in digest:
        raise ImageImportError(f"bad digest {digest!r}")
    return f"blobs/{alg}/{hexpart}"


def _layers(src: _Source) -> tuple[list[str], dict]:
    """Layer paths (bottom first) and the image config of ``src``."""
    if src.exists("manifest.json"):  # docker save
        manifest = src.json("manifest.json")
        if not isinstance(manifest, list) or not manifest or "Layers" not in manifest[0]:
            raise ImageImportError("manifest.json is not a docker save manifest")
        config = src.json(manifest[0]["Config"]) if manifest[0].get("Config") else {}
        return list(manifest[0]["Layers"]), config
    if src.exists("index.json"):  # OCI image layout
        desc = src.json("index.json")
        for _ in range(4):  # index → (nested index →) manifest
            manifests = desc.get("manifests") if isinstance(desc, dict) else None
            if not manifests:
                break
            pick = next((m for m in manifests if (m.get("platform") or {}).get("architecture") in (None, "amd64")),
                        manifests[0])
            desc = src.json(_blob(pick["digest"]))
        layers = desc.get("layers") if isinstance(desc, dict) else None
        if layers is None:
            raise ImageImportError("index.json does not lead to an image manifest with layers")
        for layer in layers:
            if "zstd" in layer.get("mediaType", ""):
                raise ImageImportError("zstd-compressed layers are not supported")
        config = src.json(_blob(desc["config"]["digest"])) if desc.get("config") else {}
        return [_blob(layer["digest"]) for layer in layers], config
    raise ImageImportError("not an image: no manifest.json (docker save) or index.json (OCI layout)")


# ------------------------------------------------------------------ applying layers
def _inside(root: Path, rel: str, follow_last: bool = False) -> Path:
    """Host path of image path ``rel`` with every symlink resolved as if ``root`` were
    ``/`` (so no path leads outside ``root``); the last component is followed only
    with ``follow_last``."""
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    resolved: list[str] = []
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        cur = root.joinpath(*resolved, part)
        if (parts or follow_last) and cur.is_symlink():
            hops += 1
            if hops > 40:
                raise ImageImportError(f"too many symlinks resolving {rel!r}")
            target = os.readlink(cur)
            if target.startswith("/"):
                resolved = []
            parts = [p for p in target.split("/") if p not in ("", ".")] + parts
            continue
        resolved.append(part)
    return root.joinpath(*resolved)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _apply_layer(root: Path, fileobj: IO[bytes]) -> None:
    """Apply one uncompressed layer tarball to ``root`` (whiteouts first: they only
    delete entries of lower layers)."""
    with tarfile.open(fileobj=fileobj, mode="r:") as tf:
        members = tf.getmembers()
        for m in members:
            name = posixpath.normpath(m.name).lstrip("/")
            base = posixpath.basename(name)
            if base == OPAQUE:
                d = _inside(root, posixpath.dirname(name), follow_last=True)
                if d.is_dir():
                    for child in d.iterdir():
                        _remove(child)
            elif base.startswith(WHITEOUT):
                _remove(_inside(root, posixpath.join(posixpath.dirname(name), base[len(WHITEOUT):])))
        dirs = []
        for m in members:
            name = posixpath.normpath(m.name).lstrip("/")
            if name in ("", ".") or posixpath.basename(name).startswith(WHITEOUT):
                continue
            target = _inside(root, name)
            _mkparents(target.parent)
            if m.isdir():
                if target.is_symlink() or (target.exists() and not target.is_dir()):
                    _remove(target)
                target.mkdir(exist_ok=True)
                dirs.append((target, m))
                continue
            if target.exists() or target.is_symlink():
                _remove(target)
            if m.isfile():
                with tf.extractfile(m) as f, open(target, "wb") as out:
                    shutil.copyfileobj(f, out)
            elif m.issym():
                os.symlink(m.linkname, target)
            elif m.islnk():
                src = _inside(root, posixpath.normpath(m.linkname).lstrip("/"))
                if src.exists():
                    os.link(src, target, follow_symlinks=False)
                continue
            elif m.isfifo():
                os.mkfifo(target)
            else:
                continue  # device nodes: the runtime provides /dev
            os.lchown(target, m.uid, m.gid)
            if not m.issym():
                os.chmod(target, stat.S_IMODE(m.mode))
                os.utime(target, (m.mtime, m.mtime))
        for target, m in reversed(dirs):
            os.lchown(target, m.uid, m.gid)
            os.chmod(target, stat.S_IMODE(m.mode))


def _mkparents(path: Path) -> None:
    """``mkdir -p`` with 0755 directories whatever the process umask (forkyard runs
    with 0077, but a directory an image implies must be traversable in the sandbox)."""
    missing = []
    while not path.exists() and not path.is_symlink():
        missing.append(path)
        path = path.parent
    for p in reversed(missing):
        p.mkdir(exist_ok=True)
        p.chmod(0o755)


def _open_layer(src: _Source, name: str) -> IO[bytes]:
    with src.open(name) as f:
        raw = f.read()
    head = raw[:4]
    if head[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    elif head == b"\x28\xb5\x2f\xfd":
        raise ImageImportError("zstd-compressed layers are not supported")
    return io.BytesIO(raw)


def _runtime_files(root: Path) -> None:
    """Add what the runtime and envd need when the image lacks it."""
    for d, mode in (("tmp", 0o1777), ("proc", 0o555), ("sys", 0o555), ("dev", 0o755), ("usr/local/bin", 0o755),
                    ("etc", 0o755), ("root", 0o700), ("run", 0o755)):
        p = _inside(root, d, follow_last=True)
        if not p.exists():
            p.mkdir(parents=True)
            p.chmod(mode)
    etc = _inside(root, "etc", follow_last=True)
    if not (etc / "passwd").exists():
        (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    if not (etc / "group").exists():
        (etc / "group").write_text("root:x:0:\n")
    for name, text in (("hosts", base_tmpl.hosts_file(base_tmpl.DEFAULT_HOSTNAME)),
                       ("hostname", base_tmpl.DEFAULT_HOSTNAME + "\n")):
        if not (etc / name).exists() and not (etc / name).is_symlink():
            (etc / name).write_text(text)
    resolv = etc / "resolv.conf"
    if resolv.is_symlink() or not resolv.exists():
        if resolv.is_symlink():
            resolv.unlink()
        resolv.write_text("".join(f"nameserver {s}\n" for s in base_tmpl.host_nameservers()))
    envd = _inside(root, "usr/local/bin/envd")
    if not envd.exists() and not envd.is_symlink():
        envd.touch(mode=0o755)


def import_image(settings: Settings, source: Path, name: str, progress: Progress = lambda line: None,
                 disk_mb: int = 0) -> registry.Template:
    """Import the image at ``source`` as rootfs template ``name``.

    Args:
        settings: where templates live (``settings.templates_dir``).
        source: an OCI image layout directory, or a tar archive of one, or ``docker save``
            output (plain or gzip-compressed tar). The first manifest is used (amd64 when
            the index lists platforms).
        name: template name (``[a-z0-9][a-z0-9_-]{0,63}``).
        progress: called with one line per layer.
        disk_mb: disk size (MiB) of the template's sandboxes, recorded in its
            :data:`~forkyard.templates.registry.SETTINGS_FILE`; 0 = the node's default.
            The caller checks it (:func:`~forkyard.templates.registry.check_disk_mb`).

    Returns:
        The new template (usable at once as ``templateID``).

    Raises:
        TemplateExists: a template ``name`` is already built here.
        ImageImportError: bad name, unreadable image, unsupported layers (zstd).
    """
    if not is_name(name):
        raise ImageImportError(f"invalid template name {name!r}")
    tdir = settings.templates_dir / name
    if (tdir / "rootfs").exists() or (tdir / registry.MARKER).exists():
        raise TemplateExists(f"template {name!r} already exists")
    src = _Source(Path(source))
    started = time.monotonic()
    try:
        layers, config = _layers(src)
        tdir.mkdir(parents=True, exist_ok=True)
        partial = tdir / ".rootfs.partial"
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir()
        partial.chmod(0o755)
        for i, layer in enumerate(layers, 1):
            progress(f"layer {i}/{len(layers)}: {layer}")
            try:
                _apply_layer(partial, _open_layer(src, layer))
            except (tarfile.TarError, EOFError, OSError) as e:
                raise ImageImportError(f"layer {layer}: {e}") from e
        _runtime_files(partial)
        if (tdir / "rootfs").exists():
            raise TemplateExists(f"template {name!r} already exists")
        if disk_mb:  # before the rootfs appears: a usable template has its settings
            registry.write_settings(tdir, disk_mb)
        partial.rename(tdir / "rootfs")
        base_tmpl.protect_rootfs(tdir / "rootfs")
        env = (config.get("config") or config.get("Config") or {}).get("Env") or []
        (tdir / registry.MARKER).write_text(
            f"imported from {source}\nlayers {len(layers)}\nenv {json.dumps(env)}\n"
            f"built {time.strftime('%Y-%m-%dT%H:%M:%S')} in {time.monotonic() - started:.1f}s\n"
        )
    except BaseException:
        if not (tdir / registry.MARKER).exists():
            partial = tdir / ".rootfs.partial"
            shutil.rmtree(partial, ignore_errors=True)
            if not (tdir / "rootfs").exists():
                shutil.rmtree(tdir, ignore_errors=True)
        raise
    finally:
        src.close()
    return registry.Template(name, tdir / "rootfs", disk_mb)


def is_imported(settings: Settings, name: str) -> bool:
    """True when rootfs template ``name`` was made by :func:`import_image`."""
    try:
        return (settings.templates_dir / name / registry.MARKER).read_text().startswith("imported")
    except OSError:
        return False


def remove_imported(settings: Settings, name: str) -> None:
    """Delete imported template ``name`` (sandboxes still running on it keep their view).

    Raises:
        ImageImportError: ``name`` is not an imported template.
    """
    if not is_name(name) or not is_imported(settings, name):
        raise ImageImportError(f"{name!r} is not an imported template")
    tdir = settings.templates_dir / name
    (tdir / registry.MARKER).unlink(missing_ok=True)
    base_tmpl.unprotect_rootfs(tdir / "rootfs")
    shutil.rmtree(tdir, ignore_errors=True)
