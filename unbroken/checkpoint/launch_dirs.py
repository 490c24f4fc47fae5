"""Checks of `--save DIR` / `--load DIR` before any worker starts, and what they mean.

The rule (docs/checkpoints.md, "Resuming: --load and --save"): a NEW launch resumes only from `--load DIR`;
`--save DIR` alone starts fresh (checkpoints already in DIR are kept, never loaded nor deleted
by this run's retention); a job-level restart inside a run resumes from the run's own
checkpoints (memory tier, then --save), then from --load's.

Pure checks on the local filesystem (URLs are left to their filesystem); they return notes
for the user (the CLI prints them, the launcher logs them as an event) and raise ConfigError
(exit 2) for a path that cannot be a checkpoint directory. Run in the launcher's process.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from unbroken.errors import ConfigError


def run_id(secret: str, job_id: str) -> str | None:
    """The id this run writes into its checkpoints (a launch of one job with one secret; a
    single-node launch makes up a new secret each time), so a restart inside the run can tell
    its own steps from older ones in the same directory. None without a secret (plain torchrun,
    one process): every step then counts as the run's own."""
    if not secret:
        return None
    return hmac.new(secret.encode(), b"unbroken-run-id\0" + job_id.encode(), hashlib.sha256).hexdigest()[:16]


def check_launch_dirs(save_dir: str | None, load_dir: str | None) -> list[str]:
    """Notes about the two directories; ConfigError for one that is unusable."""
    notes = []
    if load_dir:
        notes += _check_load(load_dir)
    if save_dir:
        notes += _check_save(save_dir, loaded=bool(load_dir) and _same(save_dir, load_dir))
    return notes


def _is_url(text: str) -> bool:
    return "://" in text


def _same(a: str, b: str) -> bool:
    return a == b or (not _is_url(a) and not _is_url(b) and Path(a).resolve() == Path(b).resolve())


def _check_load(load_dir: str) -> list[str]:
    if _is_url(load_dir):
        return []
    path = Path(load_dir)
    if not path.exists():
        return [f"--load {load_dir}: no such directory yet: starting fresh (nothing to resume)"]
    _check_is_dir(path, "--load", load_dir, write=False)
    names = os.listdir(path)
    if not names:
        return [f"--load {load_dir}: empty: starting fresh (nothing to resume)"]
    from unbroken.checkpoint.storage import StorageTier

    tier = StorageTier(path)
    if tier.committed_steps():
        return []
    if tier._step_dirs():
        return [f"--load {load_dir}: holds no committed checkpoint step (only unfinished ones): "
                "starting fresh"]
    shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
    raise ConfigError(f"--load {load_dir}: holds no unbroken checkpoint (found: {shown}); give a "
                      "directory written by `unbroken run --save`, or an empty or new one to start fresh")


def _check_save(save_dir: str, *, loaded: bool) -> list[str]:
    if _is_url(save_dir):
        return []
    path = Path(save_dir)
    if not path.exists():
        parent = next(p for p in path.absolute().parents if p.exists())
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise ConfigError(f"--save {save_dir}: cannot be created: {parent} is not a directory this "
                              "user can write; give a writable location")
        return []
    _check_is_dir(path, "--save", save_dir, write=True)
    if loaded:
        return []
    from unbroken.checkpoint.storage import StorageTier

    steps = StorageTier(path).committed_steps()
    if not steps:
        return []
    return [f"--save {save_dir}: already holds committed checkpoint steps {_listing(steps)} that this "
            "launch does not load (a new launch resumes only with --load DIR): starting fresh; they are "
            "kept: this run neither deletes nor writes over them (its own checkpoints of those step "
            "numbers are skipped)"]


def _listing(steps: list[int]) -> str:
    ordered = sorted(steps)
    return ", ".join(map(str, ordered)) if len(ordered) <= 4 else f"{ordered[0]}, ..., {ordered[-1]}"


def _check_is_dir(path: Path, flag: str, text: str, *, write: bool) -> None:
    if not path.is_dir():
        kind = "a file" if path.is_file() else "a device or special file"
        raise ConfigError(f"{flag} {text}: not a directory ({kind}); give a checkpoint directory")
    mode = os.R_OK | os.X_OK | (os.W_OK if write else 0)
    if not os.access(path, mode):
        need = "read and write" if write else "read"
        raise ConfigError(f"{flag} {text}: this user cannot {need} the directory; fix its permissions "
                          "or give another one")
