"""Import a container image (local OCI image layout or ``docker save`` tarball) as a
rootfs template — no registry access needed (:mod:`~forkyard.templates.registry` pulls
into an OCI layout and imports it here). An OCI layout's index, manifests, config and
layers are checked against their sha256 digests as they are read.

Layers are applied in order into ``<templates_dir>/<name>/.rootfs.partial`` with OCI
whiteout semantics (``.wh.NAME`` deletes ``NAME`` of lower layers, ``.wh..wh..opq``
empties its directory of lower-layer entries). Every create, write, chown, chmod and
delete happens inside the rootfs whatever the image holds (:mod:`~forkyard.beneath`:
``openat2`` with ``RESOLVE_IN_ROOT``; the last component of a path is never followed);
a member that leads outside the image (``..``) is refused; device nodes are skipped.
Layers are read as streams within the limits of :mod:`~forkyard.templates.unpack`
(unpacked bytes, entries, file size; sparse files at their apparent size, written
sparse). The result is renamed to ``rootfs``, made read-only (``ro,nosuid,nodev``) like
``base`` and marked complete with the ``.complete`` marker :mod:`forkyard.orchestrator.images`
expects (content starts with ``imported``). What the runtime needs is added when
missing: mount points for envd (``/usr/local/bin/envd``), ``/etc/hosts``,
``/etc/hostname``; ``/etc/passwd`` and ``/etc/group`` with root; ``/tmp``;
``/etc/resolv.conf`` from the host.

Every image gets working ``sudo`` (gVisor ignores setuid: :mod:`forkyard.guest.provision`
links it to envd's broker); images pulled for template builds also get E2B's default
user ``user``. envd (injected by the runtime) runs commands as root when the image has
no ``user`` account; the SDK's ``commands.run`` needs ``/bin/bash`` in the image.
"""

from __future__ import annotations

import errno
import hashlib
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
from forkyard.guest import provision
from forkyard.guest.files import host_nameservers, hosts_file
from forkyard.ids import is_name
from forkyard.orchestrator import images
from forkyard.templates import base as base_tmpl
from forkyard import beneath
from forkyard.templates import unpack

Progress = Callable[[str], None]
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
#: Largest JSON document (manifest, index, config) read from an image (bytes).
MAX_JSON_BYTES = 4 << 20


class ImageImportError(Exception):
    """The image could not be imported (bad layout, unsupported layer, bad name)."""


class TemplateExists(ImageImportError):
    """A template of that name already exists."""


# ------------------------------------------------------------------ reading the image
class _Source:
    """Uniform read access to an OCI layout directory or a tar archive of one / of
    ``docker save`` output. A gzipped archive is first decompressed next to itself
    (within ``limits``: its layers are read at random, and seeking in gzip means
    decompressing again from the start); its index of members is bounded by the
    limits' entry count."""

    def __init__(self, path: Path, limits: unpack.Limits, blobs_dir: Path | None = None):
        self.path = path
        self.blobs_dir = blobs_dir  # an OCI layout whose blobs live elsewhere (skopeo's shared blob dir)
        self.tar: tarfile.TarFile | None = None
        self._plain: Path | None = None
        if path.is_dir():
            return
        try:
            if unpack.is_gzip(path):
                self._plain = path.with_name(path.name + f".plain-{os.getpid()}")
                with open(path, "rb") as src, open(self._plain, "wb") as dst:
                    unpack.gunzip_to(src, dst, limits.stream_bytes())
                path = self._plain
            self.tar = tarfile.open(path, "r:", tarinfo=unpack._BoundedTarInfo)
            self.names = {}
            meter = unpack.Meter(unpack.Limits(limits.stream_bytes(), limits.max_files, limits.stream_bytes()))
            while (m := self.tar.next()) is not None:
                meter.count(m)
                self.names[posixpath.normpath(m.name)] = m
        except (tarfile.TarError, OSError, EOFError, unpack.ArchiveError) as e:
            self.close()
            raise ImageImportError(f"{self.path} is neither a directory nor a readable tar archive: {e}") from e
        except BaseException:
            self.close()
            raise

    def exists(self, name: str) -> bool:
        if self.tar is None:
            return (self.path / name).is_file()
        return posixpath.normpath(name) in self.names

    def open(self, name: str) -> IO[bytes]:
        name = posixpath.normpath(name)
        if name.startswith(("/", "..")):
            raise ImageImportError(f"unsafe path {name!r} in image")
        if self.tar is None:
            where = self.path / name
            if self.blobs_dir is not None and name.startswith("blobs/"):
                where = self.blobs_dir / name[len("blobs/"):]
            try:
                f = open(where, "rb")
                if self.blobs_dir is not None:
                    os.utime(f.fileno())  # the layer cache evicts the least recently used
                return f
            except OSError as e:
                raise ImageImportError(f"missing {name} in {self.path}: {e}") from e
        m = self.names.get(name)
        f = self.tar.extractfile(m) if m is not None else None
        if f is None:
            raise ImageImportError(f"missing {name} in {self.path}")
        return f

    def json(self, name: str, digest: str | None = None):
        """The JSON document ``name`` (checked against ``digest`` when given)."""
        try:
            with self.open(name) as f:
                data = f.read(MAX_JSON_BYTES + 1)
            if len(data) > MAX_JSON_BYTES:
                raise ImageImportError(f"{name} is larger than {MAX_JSON_BYTES} bytes")
            if digest is not None and digest.startswith("sha256:") and hashlib.sha256(data).hexdigest() != digest[7:]:
                raise ImageImportError(f"{name} does not match its digest {digest} (corrupt image or cache)")
            return json.loads(data)
        except ValueError as e:
            raise ImageImportError(f"{name} is not valid JSON: {e}") from e

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()
            self.tar = None
        if self._plain is not None:
            self._plain.unlink(missing_ok=True)
            self._plain = None


def _blob(digest: str) -> str:
    alg, _, hexpart = str(digest).partition(":")
    if not alg or not hexpart or "/" in digest or ".." in digest:
        raise ImageImportError(f"bad digest {digest!r}")
    return f"blobs/{alg}/{hexpart}"


def _layers(src: _Source) -> tuple[list[tuple[str, str | None]], dict]:
    """``(path, digest or None)`` of each layer (bottom first) and the image config of
    ``src``; the OCI layout's index, manifests and config are checked against their
    digests as they are read (``docker save`` names its members by path only)."""
    if src.exists("manifest.json"):  # docker save
        manifest = src.json("manifest.json")
        if not isinstance(manifest, list) or not manifest or "Layers" not in manifest[0]:
            raise ImageImportError("manifest.json is not a docker save manifest")
        config = src.json(manifest[0]["Config"]) if manifest[0].get("Config") else {}
        return [(p, None) for p in manifest[0]["Layers"]], config
    if src.exists("index.json"):  # OCI image layout
        desc = src.json("index.json")
        for _ in range(4):  # index → (nested index →) manifest
            manifests = desc.get("manifests") if isinstance(desc, dict) else None
            if not manifests:
                break
            pick = next((m for m in manifests if (m.get("platform") or {}).get("architecture") in (None, "amd64")),
                        manifests[0])
            desc = src.json(_blob(pick["digest"]), pick["digest"])
        layers = desc.get("layers") if isinstance(desc, dict) else None
        if layers is None:
            raise ImageImportError("index.json does not lead to an image manifest with layers")
        for layer in layers:
            if "zstd" in layer.get("mediaType", ""):
                raise ImageImportError("zstd-compressed layers are not supported")
        config = src.json(_blob(desc["config"]["digest"]), desc["config"]["digest"]) if desc.get("config") else {}
        return [(_blob(layer["digest"]), layer["digest"]) for layer in layers], config
    raise ImageImportError("not an image: no manifest.json (docker save) or index.json (OCI layout)")


# ------------------------------------------------------------------ applying layers
def _member_path(name: str) -> str:
    """A layer member's path inside the rootfs (``""``: the root itself).

    Raises:
        ImageImportError: it leads outside the image (``..``, ``a/../..``).
    """
    norm = posixpath.normpath("/" + name).lstrip("/")
    if posixpath.normpath(name.lstrip("/")).split("/")[0] == "..":
        raise ImageImportError(f"layer member {name!r} leads outside the image")
    return "" if norm in ("", ".") else norm


def _apply_layer(root: beneath.Root, fileobj: IO[bytes], meter: unpack.Meter) -> None:
    """Apply one layer (tar, plain or gzip, read as a stream) to ``root`` with OCI
    whiteouts: ``.wh.NAME`` removes ``NAME``, ``.wh..wh..opq`` empties its directory of
    what lower layers put there (Docker's ``UnpackLayer`` order: in archive order).
    Paths resolve inside the rootfs (:mod:`forkyard.beneath`); owners and
    modes are set on opened files, never through a link; device nodes are skipped.

    Raises:
        ImageImportError: a member leads outside the image, or its parent is not a
            directory inside it. unpack.LimitExceeded / unpack.ArchiveError.
    """
    here: set[str] = set()  # paths this layer made: an opaque whiteout keeps them
    for m, tf in unpack.members(fileobj, meter):
        rel = _member_path(m.name)
        if not rel:
            continue  # the root directory itself keeps its 0755
        parent, base = posixpath.split(rel)
        try:
            if base == OPAQUE:
                dfd = root.dir_fd(parent) if parent else os.dup(root.fd)
                try:
                    for child in beneath.Root.children(dfd, "."):
                        if posixpath.join(parent, child) not in here and child != OPAQUE:
                            beneath.Root.remove(dfd, child)
                finally:
                    os.close(dfd)
                continue
            if base.startswith(WHITEOUT):
                try:
                    dfd, name = root.parent(posixpath.join(parent, base[len(WHITEOUT):]))
                except FileNotFoundError:
                    continue
                try:
                    beneath.Root.remove(dfd, name)
                finally:
                    os.close(dfd)
                continue
            dfd, name = root.parent(rel, create=True)
            try:
                _apply_member(root, dfd, name, m, tf)
            finally:
                os.close(dfd)
            here.add(rel)
        except FileNotFoundError as e:
            raise ImageImportError(f"layer member {m.name!r}: a parent directory is a dangling link ({e})") from e
        except NotADirectoryError as e:
            raise ImageImportError(f"layer member {m.name!r}: a parent is not a directory ({e})") from e
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EXDEV):
                raise ImageImportError(f"layer member {m.name!r}: {e}") from e
            raise


def _apply_member(root: beneath.Root, dfd: int, name: str, m: tarfile.TarInfo, tf: tarfile.TarFile) -> None:
    """Create member ``m`` as ``name`` in directory ``dfd`` (never following ``name``)."""
    st = beneath.Root.lstat(dfd, name)
    if m.isdir():
        if st is not None and not stat.S_ISDIR(st.st_mode):
            beneath.Root.remove(dfd, name)
            st = None
        if st is None:
            os.mkdir(name, 0o700, dir_fd=dfd)
        fd = beneath.Root.open_dir_nofollow(dfd, name)
        try:
            beneath.Root.set_owner_mode(fd, m.uid, m.gid, m.mode)
        finally:
            os.close(fd)
        return
    if m.issym():
        beneath.Root.remove(dfd, name)
        os.symlink(m.linkname, name, dir_fd=dfd)
        os.chown(name, m.uid, m.gid, dir_fd=dfd, follow_symlinks=False)
        return
    if m.islnk():
        try:
            sfd, sname = root.parent(_member_path(m.linkname) or ".")
        except (FileNotFoundError, beneath.EscapeError):
            return  # a link to nothing in the image: skipped, as before
        try:
            sst = beneath.Root.lstat(sfd, sname)
            if sst is None or stat.S_ISDIR(sst.st_mode):
                return
            beneath.Root.remove(dfd, name)
            os.link(sname, name, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
        finally:
            os.close(sfd)
        return
    if m.isfile():
        fd = beneath.Root.create_file(dfd, name)
        try:
            src = tf.extractfile(m)
            unpack.write_data(src, fd, m.size)
            beneath.Root.set_owner_mode(fd, m.uid, m.gid, m.mode)
            os.utime(fd, (m.mtime, m.mtime))
        finally:
            os.close(fd)
        return
    if m.isfifo():
        beneath.Root.remove(dfd, name)
        os.mkfifo(name, 0o600, dir_fd=dfd)
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            beneath.Root.set_owner_mode(fd, m.uid, m.gid, m.mode)
        finally:
            os.close(fd)
    # device nodes: the runtime provides /dev


class _Digested(io.RawIOBase):
    """Reads ``inner`` and hashes what it read; :meth:`verify` reads the rest and checks
    the sha256 against ``digest`` (``sha256:<hex>``; other algorithms are not checked)."""

    def __init__(self, inner: IO[bytes], digest: str | None):
        self.inner, self.digest = inner, digest
        self.hash = hashlib.sha256() if digest and digest.startswith("sha256:") else None

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.inner.read(len(b))
        if self.hash is not None:
            self.hash.update(data)
        b[: len(data)] = data
        return len(data)

    def verify(self, name: str) -> None:
        """Raises ImageImportError when the blob does not match its digest."""
        if self.hash is None:
            return
        while self.read(1 << 20):
            pass
        if self.hash.hexdigest() != self.digest[7:]:
            raise ImageImportError(f"layer {name} does not match its digest {self.digest} (corrupt image or cache)")

    def close(self) -> None:
        self.inner.close()
        super().close()


def _open_layer(src: _Source, name: str, digest: str | None = None) -> tuple[IO[bytes], _Digested]:
    """The layer blob ``name`` of ``src``, opened for streaming (never read whole), and
    the reader under it that checks ``digest``."""
    raw = _Digested(src.open(name), digest)
    return io.BufferedReader(raw, 1 << 20), raw


def _runtime_files(root: beneath.Root) -> None:
    """Add what the runtime and envd need when the image lacks it — inside the rootfs
    whatever links the image holds (a dangling ``etc/passwd`` link is replaced by a
    file in the rootfs, never followed out of it)."""
    for d, mode in (("tmp", 0o1777), ("proc", 0o555), ("sys", 0o555), ("dev", 0o755), ("usr/local/bin", 0o755),
                    ("etc", 0o755), ("root", 0o700), ("run", 0o755)):  # parents made 0755 (an image without /usr)
        try:
            os.close(root.open(d, beneath._O_PATH))
        except FileNotFoundError:
            root.makedirs(d, mode)
    etc = root.dir_fd("etc")
    try:
        for name, text, keep_link in (
                ("passwd", "root:x:0:0:root:/root:/bin/sh\n", False),
                ("group", "root:x:0:\n", False),
                ("hosts", hosts_file(base_tmpl.DEFAULT_HOSTNAME), True),
                ("hostname", base_tmpl.DEFAULT_HOSTNAME + "\n", True)):
            if _resolves(root, f"etc/{name}") or (keep_link and beneath.Root.lstat(etc, name) is not None):
                continue
            beneath.Root.write_file(etc, name, text.encode())
        resolv = beneath.Root.lstat(etc, "resolv.conf")
        if resolv is None or stat.S_ISLNK(resolv.st_mode):
            servers = "".join(f"nameserver {s}\n" for s in host_nameservers())
            beneath.Root.write_file(etc, "resolv.conf", servers.encode())
    finally:
        os.close(etc)
    bindir = root.dir_fd("usr/local/bin")
    try:
        if beneath.Root.lstat(bindir, "envd") is None:  # the runtime's mount point for envd
            os.close(beneath.Root.create_file(bindir, "envd"))
            fd = os.open("envd", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=bindir)
            try:
                os.fchmod(fd, 0o755)
            finally:
                os.close(fd)
    finally:
        os.close(bindir)


def _resolves(root: beneath.Root, rel: str) -> bool:
    """True when ``rel`` (links followed inside the root) is an existing file."""
    try:
        os.close(root.open(rel, beneath._O_PATH))
        return True
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as e:
        if e.errno == errno.ELOOP:
            return False
        raise


def import_image(settings: Settings, source: Path, name: str, progress: Progress = lambda line: None,
                 disk_mb: int = 0, blobs_dir: Path | None = None, origin: str | None = None,
                 provision_user: bool = False) -> images.Template:
    """Import the image at ``source`` as rootfs template ``name``.

    Args:
        settings: where templates live (``settings.templates_dir``).
        source: an OCI image layout directory, or a tar archive of one, or ``docker save``
            output (plain or gzip-compressed tar). The first manifest is used (amd64 when
            the index lists platforms).
        name: template name (``[a-z0-9][a-z0-9_-]{0,63}``).
        progress: called with one line per layer.
        disk_mb: disk size (MiB) of the template's sandboxes, recorded in its
            :data:`~forkyard.templates.images.SETTINGS_FILE`; 0 = the node's default.
            The caller checks it (:func:`~forkyard.templates.images.check_disk_mb`).
        blobs_dir: where the blobs of the OCI layout ``source`` live when not under it
            (``<blobs_dir>/sha256/<hex>``, skopeo's ``--dest-shared-blob-dir``).
        origin: first line of the completion marker (default ``imported from SOURCE``;
            :mod:`~forkyard.templates.registry` writes ``pulled from REF``).
        provision_user: create E2B's default user ``user`` when the image lacks it
            (pulls for E2B template builds); either way the image gets working ``sudo``
            (:func:`forkyard.guest.provision.prepare`).

    Returns:
        The new template (usable at once as ``templateID``).

    Raises:
        TemplateExists: a template ``name`` is already built here.
        ImageImportError: bad name, unreadable image, unsupported layers (zstd), a blob
            that does not match its digest, a member leading outside the image or under a
            link that does not resolve in it.
        unpack.LimitExceeded: the image unpacks past a limit of :mod:`~forkyard.templates.unpack`
            (``FORKYARD_MAX_UNPACKED_MB`` / ``_FILES`` / ``_FILE_MB``).
    """
    if not is_name(name):
        raise ImageImportError(f"invalid template name {name!r}")
    tdir = settings.templates_dir / name
    if (tdir / "rootfs").exists() or (tdir / images.MARKER).exists():
        raise TemplateExists(f"template {name!r} already exists")
    limits = unpack.Limits.from_settings(settings)
    src = _Source(Path(source), limits, blobs_dir)
    started = time.monotonic()
    try:
        layers, config = _layers(src)
        tdir.mkdir(parents=True, exist_ok=True)
        partial = tdir / ".rootfs.partial"
        if partial.is_symlink() or partial.exists():
            _remove_tree(partial)
        partial.mkdir()
        partial.chmod(0o755)
        meter = unpack.Meter(limits)  # the layers together
        with beneath.Root(partial) as root:
            for i, (layer, digest) in enumerate(layers, 1):
                progress(f"layer {i}/{len(layers)}: {digest or layer}")
                try:
                    f, raw = _open_layer(src, layer, digest)
                    with f:
                        _apply_layer(root, f, meter)
                        raw.verify(layer)
                except unpack.ArchiveError as e:
                    raise ImageImportError(f"layer {layer}: {e}") from e
                except (tarfile.TarError, EOFError, OSError) as e:
                    raise ImageImportError(f"layer {layer}: {e}") from e
            try:
                _runtime_files(root)
                for line in provision.prepare(root, create_user=provision_user):
                    progress(line)
            except (OSError, beneath.EscapeError) as e:  # e.g. /etc a link that resolves to nothing in the image
                raise ImageImportError(f"cannot add the runtime's files: {e} (a link in the image that does not "
                                       "resolve inside it?)") from e
        if (tdir / "rootfs").exists():
            raise TemplateExists(f"template {name!r} already exists")
        if disk_mb:  # before the rootfs appears: a usable template has its settings
            images.write_settings(tdir, disk_mb)
        partial.rename(tdir / "rootfs")
        base_tmpl.protect_rootfs(tdir / "rootfs")
        env = (config.get("config") or config.get("Config") or {}).get("Env") or []
        (tdir / images.MARKER).write_text(
            f"{origin or f'imported from {source}'}\nlayers {len(layers)}\nenv {json.dumps(env)}\n"
            f"built {time.strftime('%Y-%m-%dT%H:%M:%S')} in {time.monotonic() - started:.1f}s\n"
        )
    except BaseException:
        if not (tdir / images.MARKER).exists():
            _remove_tree(tdir / ".rootfs.partial")
            if not (tdir / "rootfs").exists():
                _remove_tree(tdir)
        raise
    finally:
        src.close()
    return images.Template(name, tdir / "rootfs", disk_mb)


def _remove_tree(path: Path) -> None:
    """Remove ``path`` (a link itself, never what it points to; a tree fd by fd)."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def is_imported(settings: Settings, name: str) -> bool:
    """True when rootfs template ``name`` was made by :func:`import_image`."""
    try:
        return (settings.templates_dir / name / images.MARKER).read_text().startswith("imported")
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
    (tdir / images.MARKER).unlink(missing_ok=True)
    base_tmpl.unprotect_rootfs(tdir / "rootfs")
    shutil.rmtree(tdir, ignore_errors=True)
