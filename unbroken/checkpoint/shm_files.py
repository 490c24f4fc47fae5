"""The files of the memory tier in a tmpfs directory: names, ownership, clean-up.

One job's files on a node (``shm_dir``, /dev/shm by default)::

    unbroken-{job}-r{rank:05d}-s{0,1}   the two snapshot slots of a rank (unbroken.checkpoint.memory)
    unbroken-{job}-r{rank:05d}.persisted  the newest step of that rank the agent has in storage
    unbroken-{job}.owner                  JSON {pid, create_time} of the agent that owns them

The node's agent claims a job's files, removes them when the job ends, and sweeps the files
of jobs whose owner is gone; it never touches a live job's files or names that are not ours.

How much room the files need is :mod:`unbroken.checkpoint.capacity`.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import psutil

from unbroken.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

DEFAULT_SHM_DIR = "/dev/shm"
_JOB_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_SLOT_RE = re.compile(r"^unbroken-(?P<job>[A-Za-z0-9_.-]{1,64})-r\d{5,}(-s[01]|\.persisted(\.tmp)?)$")
_OWNER_RE = re.compile(r"^unbroken-(?P<job>[A-Za-z0-9_.-]{1,64})\.owner$")


def slot_path(shm_dir: str | os.PathLike | None, job_id: str, rank: int, slot: int) -> Path:
    """Path of slot file `slot` (0 or 1) of `rank` of `job_id`; shm_dir None means /dev/shm."""
    check_job_id(job_id)
    if type(rank) is not int or rank < 0 or slot not in (0, 1):
        raise ConfigError(f"rank must be an int >= 0 and slot 0 or 1, got {rank!r}, {slot!r}")
    return Path(shm_dir or DEFAULT_SHM_DIR) / f"unbroken-{job_id}-r{rank:05d}-s{slot}"


def persisted_path(shm_dir: str | os.PathLike | None, job_id: str, rank: int) -> Path:
    """The marker holding the newest step of `rank` the agent has persisted to storage."""
    return check_dir(shm_dir) / f"unbroken-{check_job_id(job_id)}-r{rank:05d}.persisted"


def read_persisted(path: Path) -> int:
    try:
        return int(path.read_text() or -1)
    except (FileNotFoundError, ValueError):
        return -1


def mark_persisted(shm_dir: str | os.PathLike | None, job_id: str, rank: int, step: int) -> None:
    """Tell `rank`'s writer that `step` is in storage: its held snapshot may be overwritten."""
    path = persisted_path(shm_dir, job_id, rank)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
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
    fd = open_slot(path, os.O_TRUNC)  # a torn write reads as unreadable: never swept
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


def open_slot(path: Path, flags: int = 0) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o600)
    os.fchmod(fd, 0o600)  # umask-proof
    return fd


def _owner(path: Path) -> tuple[int, bool] | None:
    """(pid, alive) from an owner file, None if unreadable. Alive: the pid runs and started
    when the owner did (a recycled pid is another process)."""
    try:
        owner = json.loads(path.read_bytes())
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
    """Bytes allocated to `job_id`'s slot and marker files in `directory`."""
    total = 0
    for name in os.listdir(directory):
        match = _SLOT_RE.match(name)
        if match and match.group("job") == job_id:
            try:
                total += os.stat(directory / name).st_blocks * 512
            except FileNotFoundError:
                pass
    return total
