"""Functions behind `unbroken ckpt ls|show|verify|export DIR`: they return data, never print.

DIR is anything StorageTier takes: a local path, `file://`, or an fsspec URL (`s3://...`).
Read-only except `export`, which writes one new local file (or, for DCP, one new local
directory) at the path it is given.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import warnings
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from unbroken.checkpoint.storage import StorageTier, _AnyPath, describe, step_dir_name
from unbroken.errors import CheckpointCorrupt, CheckpointError, ConfigError, NoCheckpoint

EXPORT_FORMATS = ("safetensors", "torch", "dcp")
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header


def check_dir(root: str | os.PathLike, flag: str = "DIR", *, missing_ok: bool = True) -> None:
    """ConfigError naming `flag` unless a local `root` is a readable directory (or, with
    `missing_ok`, does not exist yet). URLs are left to their filesystem."""
    text = os.fspath(root)
    if "://" in str(text):
        return
    path = Path(text)
    if not path.exists():
        if missing_ok:
            return
        raise ConfigError(f"{flag} {text}: no such directory")
    if not path.is_dir():
        raise ConfigError(f"{flag} {text}: not a directory ({_kind(path)}); give a checkpoint directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise ConfigError(f"{flag} {text}: the directory cannot be read by this user; fix its permissions")


def _kind(path: Path) -> str:
    return "a device or special file" if not path.is_file() else "a file"


def list_steps(root: str | os.PathLike) -> list[dict]:
    """`describe(root)` (newest first) with `latest: bool` marking the step loads pick."""
    check_dir(root)
    latest = StorageTier(root).latest_step()
    return [{**row, "latest": row["step"] == latest} for row in describe(root)]


def show_step(root: str | os.PathLike, step: int | None = None) -> dict:
    """What a committed step holds: meta, and per rank its file, bytes, crc32, meta and
    tensors (name, dtype, shape, bytes), read from headers without loading the data."""
    check_dir(root)
    tier = StorageTier(root)
    step = _resolve_step(tier, step)
    manifest = tier._read_manifest(step)
    ranks = []
    for entry in manifest["ranks"]:
        record = tier._read_record(step, entry["rank"])
        path = tier.root / step_dir_name(step) / entry["file"]
        ranks.append({"rank": entry["rank"], "file": str(path), "bytes": entry["bytes"],
                      "crc32": entry["crc32"], "meta": record.get("meta") or {},
                      "tensors": _tensor_table(tier, path)})
    return {"step": step, "world_size": manifest["world_size"],
            "created_unix": manifest.get("created_unix"), "meta": manifest.get("meta") or {},
            "ranks": ranks}


def verify(root: str | os.PathLike, step: int | None = None) -> list[str]:
    """Problems in `step`, or in every committed step when None; empty means all OK."""
    check_dir(root)
    tier = StorageTier(root)
    if not tier._files.is_dir(tier.root):
        return [f"{root}: no such checkpoint directory"]
    if step is not None:
        return tier.verify_step(step)
    # every step with a manifest: a damaged manifest is a problem to report, not a step to skip
    steps = sorted((s for s in tier._step_dirs() if tier._files.size(tier._step_dir(s) / "MANIFEST.json")
                    is not None), reverse=True)
    if not steps:
        return [f"{root}: no committed checkpoint (no step_XXXXXXXX/MANIFEST.json of ours)"]
    return [problem for s in steps for problem in tier.verify_step(s)]


def export(root: str | os.PathLike, out_path: str | os.PathLike, step: int | None = None,
           fmt: str = "safetensors", rank: int = 0, subtree: str = "model") -> dict:
    """Write `rank`'s `subtree` (a flat {name: tensor} state dict) of `step` to `out_path`.

    `fmt="safetensors"` writes one file that loads with `safetensors.torch.load_file`,
    `fmt="torch"` one for `torch.load(path, weights_only=True)`, `fmt="dcp"` a new
    torch.distributed.checkpoint directory for `dcp.load(state_dict, checkpoint_id=path)`
    (an existing non-empty `out_path` is refused). Returns {path, step, rank, tensors, bytes}.
    """
    if fmt not in EXPORT_FORMATS:
        raise ConfigError(f"export format {fmt!r} is not supported; use one of {EXPORT_FORMATS}")
    out = Path(out_path)
    check_dir(root)
    _check_out(root, out, fmt)
    if fmt == "dcp":
        _check_new_dir(out)  # before any loading: never touch a user's directory
    tier = StorageTier(root)
    step = _resolve_step(tier, step)
    state, _ = tier.load_rank(step, rank)
    if isinstance(state, dict) and isinstance(state.get("tracked"), dict):
        state = state["tracked"]  # the worker session keeps tracked objects under 'tracked'
    if not isinstance(state, dict) or subtree not in state:
        keys = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"step {step} rank {rank} has no {subtree!r} entry to export "
                              f"(top-level keys: {keys})")
    tensors = _plain_state_dict(state[subtree], f"{subtree!r} of step {step} rank {rank}")
    if fmt == "dcp":
        return {"path": str(out), "step": step, "rank": rank, "tensors": len(tensors),
                "bytes": _write_dcp(tensors, out)}
    tmp = out.with_name(f".{out.name}.tmp-{os.urandom(4).hex()}")
    try:
        if fmt == "safetensors":
            safetensors.torch.save_file(tensors, str(tmp), metadata={"unbroken.step": str(step)})
        else:
            torch.save(tensors, tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return {"path": str(out), "step": step, "rank": rank, "tensors": len(tensors),
            "bytes": out.stat().st_size}


def _check_out(root: str | os.PathLike, out: Path, fmt: str) -> None:
    """ConfigError unless `out` can be written: its directory exists, and it is not the
    checkpoint directory, `latest`, or anything inside a step directory of it."""
    parent = out.resolve().parent
    if not parent.is_dir():
        raise ConfigError(f"export --out {out}: directory {parent} does not exist; create it first "
                          "or pick another path")
    if fmt != "dcp" and out.is_dir():
        raise ConfigError(f"export --out {out}: is a directory; give a file path (or --format dcp)")
    if "://" in os.fspath(root):
        return
    base, target = Path(root).resolve(), out.resolve()
    inside = target == base or target == base / "latest" or (
        target.is_relative_to(base) and target.relative_to(base).parts[0].startswith("step_"))
    if inside:
        raise ConfigError(f"export --out {out}: is part of the checkpoint {root} itself; export "
                          "never overwrites a checkpoint's files: write outside its step directories")


def _check_new_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"export --out {out}: exists and is not an empty directory; a DCP "
                          "export writes a new directory and never overwrites one. Pick a "
                          "new path or remove it yourself.")


def _write_dcp(tensors: dict[str, torch.Tensor], out: Path) -> int:
    """Save `tensors` as a DCP directory at `out` (missing or empty); return its bytes.

    Written into a temporary sibling, then renamed, so `out` is complete or absent.
    `no_dist=True`: a plain single-process save, no collectives even if this process
    happens to have a process group.
    """
    import torch.distributed.checkpoint as dcp

    tmp = out.with_name(f".{out.name}.tmp-{os.urandom(4).hex()}")
    try:
        with warnings.catch_warnings():  # DCP warns that it saves in one process: intended
            warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled",
                                    category=UserWarning)
            dcp.save(tensors, checkpoint_id=tmp, no_dist=True)
        _check_new_dir(out)  # again: it may have appeared while we were writing
        os.replace(tmp, out)  # onto a missing or empty directory: atomic on POSIX
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sum(f.stat().st_size for f in out.rglob("*") if f.is_file())


def _resolve_step(tier: StorageTier, step: int | None) -> int:
    if step is None:
        step = tier.latest_step()
        if step is None:
            raise NoCheckpoint(f"{tier.root}: no committed checkpoint to read")
    return step


def _plain_state_dict(tree: Any, what: str) -> dict[str, torch.Tensor]:
    """A flat str -> tensor dict with no shared storage (tied weights get their own copy)."""
    if not isinstance(tree, dict):
        raise CheckpointError(f"{what} is a {type(tree).__name__}, not a state dict")
    out, seen = {}, set()
    for name, value in tree.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{what}: entry {name!r} ({type(value).__name__}) is not a "
                                  "str -> tensor pair; only flat state dicts can be exported")
        ptr = value.untyped_storage().data_ptr()
        out[name] = value.clone() if ptr in seen else value.contiguous()
        if value.untyped_storage().nbytes():
            seen.add(ptr)
    return out


def _tensor_table(tier: StorageTier, path: _AnyPath) -> list[dict]:
    """[{name, dtype, shape, bytes}] from a safetensors header (data is not read)."""
    try:
        with tier._files.open_read(path) as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > _MAX_HEADER_BYTES:
                raise ValueError(f"header length {header_len} is implausible")
            header = json.loads(f.read(header_len))
        return [{"name": name, "dtype": info["dtype"], "shape": info["shape"],
                 "bytes": info["data_offsets"][1] - info["data_offsets"][0]}
                for name, info in header.items() if name != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise CheckpointCorrupt(f"{path}: unreadable safetensors header ({exc})") from exc
