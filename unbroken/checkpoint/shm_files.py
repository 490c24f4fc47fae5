"""The files of the memory tier in a tmpfs directory: names, ownership, clean-up.

One job's files on a node (``shm_dir``, /dev/shm by default)::

    unbroken-{job}-r{rank:05d}-s{0,1}   the two snapshot slots of a rank (unbroken.checkpoint.memory)
    unbroken-{job}-r{rank:05d}.persisted  the newest step of that rank the agent has in storage
    unbroken-{job}-r{rank:05d}.peer       the seq and step of a slot fetched from a peer node at a restore
    unbroken-{job}-r{rank:05d}.own        the rank's own state as its step's reduction began, for its agent
                                          to send on if it dies (unbroken.checkpoint.own_state)
    unbroken-{job}-p{rank:05d}-s{0,1}   the two slots of another node's rank kept here (its peer copy,
                                          unbroken.checkpoint.peer_copy)
    unbroken-{job}.owner                  JSON {pid, create_time} of the agent that owns them

The node's agent claims a job's files, removes them when the job ends, and sweeps the files
of jobs whose owner is gone; it never touches a live job's files or names that are not ours.

Anyone on the host may create entries in a shared tmpfs directory, so no file is opened by
following a link: a new file is created exclusively (O_CREAT|O_EXCL|O_NOFOLLOW), an existing one
is used only when it is a regular file of this user with one link and mode 0600 (`open_slot`,
`open_ours`). An entry with one of our names that fails this (a symlink planted by another user,
a hard link, a file of another user) is removed, which never touches what it points to, and
replaced by our own file, with a warning; when it cannot be removed, CheckpointError says so.

How much room the files need is :mod:`unbroken.checkpoint.capacity`.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
from pathlib import Path
from typing import Any

import psutil

from unbroken.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

DEFAULT_SHM_DIR = "/dev/shm"
_JOB_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_SLOT_RE = re.compile(r"^unbroken-(?P<job>[A-Za-z0-9_.-]{1,64})-(r\d{5,}(-s[01]|\.persisted(\.tmp)?|\.peer(\.tmp)?|\.own)"
                      r"|(?P<peer>p\d{5,}-s[01]))$")
_OWNER_RE = re.compile(r"^unbroken-(?P<job>[A-Za-z0-9_.-]{1,64})\.owner$")


def slot_path(shm_dir: str | os.PathLike | None, job_id: str, rank: int, slot: int) -> Path:
    """Path of slot file `slot` (0 or 1) of `rank` of `job_id`; shm_dir None means /dev/shm."""
    check_job_id(job_id)
    if type(rank) is not int or rank < 0 or slot not in (0, 1):
        raise ConfigError(f"rank must be an int >= 0 and slot 0 or 1, got {rank!r}, {slot!r}")
    return Path(shm_dir or DEFAULT_SHM_DIR) / f"unbroken-{job_id}-r{rank:05d}-s{slot}"


def own_state_path(shm_dir: str | os.PathLike | None, job_id: str, rank: int) -> Path:
    """The file of `rank`'s own state for its agent (unbroken.checkpoint.own_state)."""
    return slot_path(shm_dir, job_id, rank, 0).with_name(f"unbroken-{job_id}-r{rank:05d}.own")


def peer_slot_path(shm_dir: str | os.PathLike | None, job_id: str, rank: int, slot: int) -> Path:
    """Path of slot `slot` of the peer copy of `rank` (another node's rank) this node keeps."""
    own = slot_path(shm_dir, job_id, rank, slot)
    return own.with_name(own.name.replace(f"-r{rank:05d}-", f"-p{rank:05d}-"))


def peer_marker_path(shm_dir: str | os.PathLike | None, job_id: str, rank: int) -> Path:
    """The marker naming the snapshot of `rank` this node fetched from a peer node's copy."""
    return check_dir(shm_dir) / f"unbroken-{check_job_id(job_id)}-r{rank:05d}.peer"


def write_json_marker(path: Path, value: dict) -> None:
    """Replace our file at `path` with `value` as JSON (temporary name, then rename)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = open_slot(tmp, truncate=True)
    try:
        os.write(fd, json.dumps(value).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def persisted_path(shm_dir: str | os.PathLike | None, job_id: str, rank: int) -> Path:
    """The marker holding the newest step of `rank` the agent has persisted to storage."""
    return check_dir(shm_dir) / f"unbroken-{check_job_id(job_id)}-r{rank:05d}.persisted"


def read_persisted(path: Path) -> int:
    raw = read_ours(path)
    try:
        return int(raw or -1)
    except ValueError:
        return -1


def mark_persisted(shm_dir: str | os.PathLike | None, job_id: str, rank: int, step: int) -> None:
    """Tell `rank`'s writer that `step` is in storage: its held snapshot may be overwritten."""
    path = persisted_path(shm_dir, job_id, rank)
    tmp = path.with_name(path.name + ".tmp")
    fd = open_slot(tmp, truncate=True)
    try:
        os.write(fd, str(step).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)



def claim_job(shm_dir: str | os.PathLike | None, job_id: str, pid: int) -> Path:
    """Record `pid` (the node agent) as owner of `job_id`'s files; CheckpointError if another
    live process owns them."""
    path = check_dir(shm_dir) / f"unbroken-{check_job_id(job_id)}.owner"
    current = _owner(path)
    if current is not None and current[0] != pid and current[1]:
        raise CheckpointError(f"job {job_id!r} is owned by live process {current[0]} ({path}); "
                              "stop that agent first")
    try:
        started = psutil.Process(pid).create_time()
    except psutil.Error:
        started = None
    fd = open_slot(path, truncate=True)  # a torn write reads as unreadable: never swept
    try:
        os.write(fd, json.dumps({"pid": pid, "create_time": started}).encode())
    finally:
        os.close(fd)
    return path


def remove_job(shm_dir: str | os.PathLike | None, job_id: str) -> list[Path]:
    """Unlink every slot file and the owner file of `job_id`; return the paths removed."""
    directory, removed = check_dir(shm_dir), []
    check_job_id(job_id)
    for name in sorted(os.listdir(directory)):
        match = _SLOT_RE.match(name) or _OWNER_RE.match(name)
        if match and match.group("job") == job_id:
            try:
                (directory / name).unlink()
                removed.append(directory / name)
            except FileNotFoundError:
                pass
    return removed


def sweep_stale(shm_dir: str | os.PathLike | None) -> list[str]:
    """Remove the files of every job whose owner process is gone; return those job ids.

    A job whose owner lives, or whose owner file is unreadable (warned), is left alone, and
    so is every file whose name is not one of ours.
    """
    directory, swept = check_dir(shm_dir), []
    for name in sorted(os.listdir(directory)):
        match = _OWNER_RE.match(name)
        if not match:
            continue
        owner = _owner(directory / name)
        if owner is None:
            logger.warning("not sweeping job %r: unreadable owner file %s", match.group("job"),
                           directory / name)
        elif not owner[1]:
            remove_job(directory, match.group("job"))
            swept.append(match.group("job"))
    return swept


def open_slot(path: Path, *, truncate: bool = False) -> int:
    """A read-write fd of our file at `path`, created 0600 if missing; never through a link.

    An entry that is not ours (see the module docstring) is removed and replaced, with a
    warning; CheckpointError when it cannot be removed or keeps coming back.
    """
    for _ in range(_OPEN_ATTEMPTS):
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o600)
            except FileExistsError:  # created meanwhile: look at it again
                continue
            os.fchmod(fd, 0o600)  # umask-proof
            return fd
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            _remove_foreign(path, "it is a symbolic link")
            continue
        problem = _foreign(os.fstat(fd))
        if problem is None:
            if truncate:
                os.ftruncate(fd, 0)
            return fd
        os.close(fd)
        _remove_foreign(path, problem)
    raise CheckpointError(f"{path} is replaced by a file that is not ours each time it is removed "
                          f"({_OPEN_ATTEMPTS} attempts): another user interferes with "
                          f"{path.parent}; use a private --shm-dir (mode 0700)")


def open_ours(path: Path, flags: int = os.O_RDONLY) -> int | None:
    """An fd of the existing file at `path` if it is ours (see the module docstring), else None
    (missing, a link, another user's file: never read, never removed)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    if _foreign(os.fstat(fd)) is not None:
        os.close(fd)
        return None
    return fd


def read_ours(path: Path, max_bytes: int = 1 << 16) -> bytes | None:
    """The first `max_bytes` of our file at `path` (open_ours), None if it is missing or not ours."""
    fd = open_ours(path)
    if fd is None:
        return None
    try:
        return os.read(fd, max_bytes)
    except OSError:
        return None
    finally:
        os.close(fd)


_OPEN_ATTEMPTS = 3


def _foreign(st: os.stat_result) -> str | None:
    """Why a file with this stat is not one of ours, or None if it is."""
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid != os.geteuid():
        return f"it belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_nlink != 1:
        return f"it has {st.st_nlink} hard links"
    if st.st_mode & 0o077:
        return f"its mode is {stat.S_IMODE(st.st_mode):o}, not 600"
    return None


def _remove_foreign(path: Path, problem: str) -> None:
    """Unlink the entry at `path` (a link is removed, never its target)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise CheckpointError(
            f"{path} is not a file of this job ({problem}) and cannot be removed "
            f"({exc.strerror or exc}); remove it as its owner or root, or start the job with "
            f"another --rdzv-id or a private --shm-dir") from exc
    logger.warning("removed %s: %s, not a file of this job (planted by another user?); "
                   "what it pointed to is untouched", path, problem)


def _owner(path: Path) -> tuple[int, bool] | None:
    """(pid, alive) from an owner file, None if unreadable. Alive: the pid runs and started
    when the owner did (a recycled pid is another process)."""
    try:
        owner = json.loads(read_ours(path) or b"")
        pid, recorded = owner["pid"], owner.get("create_time")
        if type(pid) is not int:
            return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    try:
        started = psutil.Process(pid).create_time()
    except psutil.Error:
        return pid, False
    return pid, not isinstance(recorded, (int, float)) or abs(started - recorded) < 0.01


def check_dir(shm_dir: str | os.PathLike | None) -> Path:
    path = Path(shm_dir or DEFAULT_SHM_DIR)
    if not path.is_dir():
        raise ConfigError(f"shared-memory directory {path} does not exist or is not a directory;"
                          f" pass an existing tmpfs directory (default {DEFAULT_SHM_DIR})")
    return path


def check_job_id(job_id: Any) -> str:
    if not isinstance(job_id, str) or not _JOB_RE.fullmatch(job_id):
        raise ConfigError(f"job id {job_id!r} is invalid: use 1-64 of A-Z a-z 0-9 _ . -")
    return job_id


def job_bytes(directory: Path, job_id: str) -> int:
    """Bytes allocated to `job_id`'s slot and marker files in `directory` (not its peer copies: those
    another node sends may need more room later)."""
    total = 0
    for name in os.listdir(directory):
        match = _SLOT_RE.match(name)
        if match and match.group("job") == job_id and not match.group("peer"):
            try:
                total += os.stat(directory / name).st_blocks * 512
            except FileNotFoundError:
                pass
    return total
