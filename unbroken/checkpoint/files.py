"""Where the storage tier's bytes go: a local directory, or any fsspec filesystem.

Two small backends with the same private operations, chosen by :func:`open_root` from the
checkpoint root. The local one keeps every durability step (temporary name, fsync, rename,
directory fsync; files 0o600, directories 0o700); the fsspec one writes a temporary object
and moves it to its final name (object stores have no atomic rename or fsync).
"""

from __future__ import annotations

import os
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterable, Union

from unbroken.errors import ConfigError

_CHUNK_BYTES = 4 << 20
# What write_atomic writes: bytes, or buffers written one after the other (a file streamed
# from tensors without joining them into one bytes object first).
Data = Union[bytes, Iterable[Any]]


def _parts(data: Data) -> Iterable[Any]:
    return (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data


class _LocalFiles:
    """File operations on a local directory (durable: fsync, modes 0o600/0o700).

    This class and `_FsspecFiles` are the only places that touch storage; a StorageTier
    picks one from its root (see `open_root`).
    """

    def write_atomic(self, path: Path, data: Data) -> None:
        """Write `data` to `path` via tmp + fsync + rename + directory fsync (mode 0o600)."""
        tmp = path.with_name(f"{path.name}.tmp-{os.urandom(4).hex()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.fchmod(fd, 0o600)  # umask-proof
                for part in _parts(data):
                    view = memoryview(part).cast("B")
                    while view:
                        view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.fsync_dir(path.parent)

    def fsync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)  # makes the rename / new entry itself durable
        finally:
            os.close(fd)

    def make_dir(self, path: Path) -> None:
        """Create `path` (and missing parents) with mode 0o700; leave an existing one alone."""
        if not path.parent.exists():
            self.make_dir(path.parent)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            return
        os.chmod(path, 0o700)  # umask-proof
        self.fsync_dir(path.parent)

    def read_bytes(self, path: Path) -> bytes:
        return path.read_bytes()

    def size(self, path: Path) -> int | None:
        try:
            return path.stat().st_size
        except FileNotFoundError:
            return None

    def crc32(self, path: Path) -> int:
        crc = 0
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK_BYTES):
                crc = zlib.crc32(chunk, crc)
        return crc

    def list_dir(self, path: Path) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    def is_dir(self, path: Path) -> bool:
        return path.is_dir()

    def is_real_dir(self, path: Path) -> bool:
        return path.is_dir() and not path.is_symlink()

    def open_read(self, path: Path) -> IO[bytes]:
        return open(path, "rb")

    def remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def remove_tree(self, path: Path) -> None:
        shutil.rmtree(path)


@dataclass(frozen=True)
class _ObjectPath:
    """A path on an fsspec filesystem: `url` names it in messages, `fs_path` is what the
    filesystem's methods take. Offers the pathlib operations StorageTier uses."""

    url: str
    fs_path: str

    def __truediv__(self, name: str) -> _ObjectPath:
        return _ObjectPath(f"{self.url}/{name}", f"{self.fs_path}/{name}")

    @property
    def name(self) -> str:
        return self.fs_path.rsplit("/", 1)[-1]

    @property
    def parent(self) -> _ObjectPath:
        return _ObjectPath(self.url.rsplit("/", 1)[0], self.fs_path.rsplit("/", 1)[0])

    def with_name(self, name: str) -> _ObjectPath:
        return self.parent / name

    def __str__(self) -> str:
        return self.url


_AnyPath = Union[Path, _ObjectPath]


class _FsspecFiles:
    """The operations of `_LocalFiles` on any fsspec filesystem (object stores included).

    No fsync (the filesystem decides durability) and no rename: a file is written as a
    temporary object, then moved (copy + delete on object stores), so a reader sees the old
    object, the new one, or none, never a partial one. Listings and sizes drop the
    filesystem's listing cache first: another process (a persister, a controller) may have
    written since. Safe to use from any thread, like the fsspec filesystem itself.
    """

    def __init__(self, fs: Any) -> None:
        self._fs = fs

    def write_atomic(self, path: _ObjectPath, data: Data) -> None:
        tmp = path.with_name(f"{path.name}.tmp-{os.urandom(4).hex()}")
        try:
            if isinstance(data, bytes):
                self._fs.pipe_file(tmp.fs_path, data)
            else:
                with self._fs.open(tmp.fs_path, "wb") as f:
                    for part in data:
                        f.write(part)
            self._fs.mv(tmp.fs_path, path.fs_path)
        except BaseException:
            try:
                self.remove(tmp)
            except OSError:
                pass  # keep the original error; a stray .tmp- object is ours, retention removes it
            raise

    def fsync_dir(self, path: _ObjectPath) -> None:
        pass  # nothing to sync: an object is durable (or not) once its write returned

    def make_dir(self, path: _ObjectPath) -> None:
        self._fs.makedirs(path.fs_path, exist_ok=True)  # a no-op on most object stores

    def read_bytes(self, path: _ObjectPath) -> bytes:
        return self._fs.cat_file(path.fs_path)

    def size(self, path: _ObjectPath) -> int | None:
        self._fs.invalidate_cache(path.fs_path)
        try:
            return self._fs.size(path.fs_path)
        except FileNotFoundError:
            return None

    def crc32(self, path: _ObjectPath) -> int:
        crc = 0
        with self.open_read(path) as f:
            while chunk := f.read(_CHUNK_BYTES):
                crc = zlib.crc32(chunk, crc)
        return crc

    def list_dir(self, path: _ObjectPath) -> list[str]:
        self._fs.invalidate_cache(path.fs_path)
        try:
            entries = self._fs.ls(path.fs_path, detail=False)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def is_dir(self, path: _ObjectPath) -> bool:
        self._fs.invalidate_cache(path.fs_path)
        return self._fs.isdir(path.fs_path)

    is_real_dir = is_dir  # no symlinks on object stores

    def open_read(self, path: _ObjectPath) -> IO[bytes]:
        return self._fs.open(path.fs_path, "rb")

    def remove(self, path: _ObjectPath) -> None:
        try:
            self._fs.rm_file(path.fs_path)
        except FileNotFoundError:
            pass

    def remove_tree(self, path: _ObjectPath) -> None:
        self._fs.rm(path.fs_path, recursive=True)


def open_root(root: str | os.PathLike) -> tuple[_AnyPath, _LocalFiles | _FsspecFiles]:
    """(root path, files backend) for a local path, a `file://` URL or an fsspec URL.

    Raises ConfigError naming the URL when its protocol has no installed fsspec plugin.
    """
    text = os.fspath(root)
    if isinstance(text, bytes) or "://" not in text:  # a plain path, even one with "::"
        return Path(root), _LocalFiles()
    try:
        import fsspec.core
        from fsspec.implementations.local import LocalFileSystem
        from fsspec.registry import known_implementations
    except ImportError as exc:
        raise ConfigError(f"checkpoint location {text!r} is a URL, which needs the fsspec "
                          f"package: pip install fsspec ({exc})") from exc
    protocol = text.split("://", 1)[0].split("::")[0]
    try:
        fs, fs_path = fsspec.core.url_to_fs(text)
    except ImportError as exc:  # a protocol fsspec knows, whose plugin is not installed
        plugin = known_implementations.get(protocol, {}).get("class", "?").split(".")[0]
        raise ConfigError(
            f"checkpoint location {text!r}: the fsspec plugin for protocol {protocol!r} "
            f"({plugin}) is not installed: pip install {plugin} ({exc})") from exc
    except ValueError as exc:  # fsspec: "Protocol not known"
        raise ConfigError(
            f"checkpoint location {text!r}: no fsspec plugin provides protocol {protocol!r} "
            f"({exc}); install the fsspec plugin for it, or give a local path") from exc
    if type(fs) is LocalFileSystem:  # file:// keeps the durable local backend
        return Path(fs_path), _LocalFiles()
    url = text.rstrip("/") if not text.endswith("://") else text
    return _ObjectPath(url, fs_path.rstrip("/")), _FsspecFiles(fs)
