"""Storage tier of the checkpoint engine: durable, checksummed, committed-by-manifest steps.

`root` is a local directory (a path or a `file://` URL) or any fsspec URL (`memory://`,
`s3://`, `gs://`, ... with that protocol's fsspec plugin installed). Layout under `root`:

    root/step_00000030/rank_00000.safetensors  tensors (header metadata carries the spec too)
    root/step_00000030/rank_00000.json         rank record: step, rank, spec, bytes, crc32, meta
    root/step_00000030/MANIFEST.json           written LAST: the only commit point; the crc32 of
                                               every rank's two files, and of itself
    root/latest                                "step_00000030", replaced atomically

Every file is written to a temporary name in its final directory, fsynced, renamed, and
the directory fsynced, so a crash or a full disk leaves either the old file or the new one.
Object stores have no atomic rename or fsync: there a file is a temporary object moved to
its final name, which is still all-or-nothing per object. A step is committed iff its
MANIFEST.json (written last) parses and is ours; nothing is ever loaded before its size and
crc32 match the manifest. Every file of a step is covered by a crc32 (unbroken.checkpoint.
step_checks): a changed rank record or manifest is as corrupt as a changed tensor file.
Version 1 steps (no record or manifest checksum) are still read.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import time
import zlib
from typing import Any, Callable, Iterator

from unbroken.checkpoint.files import _AnyPath, open_root
from unbroken.checkpoint.step_checks import (MANIFEST_CRC_FIELD, check_agreement, check_bytes, check_format,
                                             check_manifest, check_record, manifest_crc, safetensors_names)
from unbroken.errors import CheckpointCorrupt, CheckpointError, ConfigError

logger = logging.getLogger(__name__)

FORMAT = "unbroken-checkpoint"
VERSION = 2  # 2: the manifest holds the crc32 of each rank record and of itself
_READABLE_VERSIONS = (1, 2)
MANIFEST = "MANIFEST.json"
LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d{8,})$")
# Names we write inside a step dir; a step dir holding anything else is never deleted.
_OWN_FILE_RE = re.compile(r"^(MANIFEST\.json|rank_\d{5,}\.(safetensors|json))(\.tmp-[0-9a-f]+)?$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_file_names(rank: int) -> tuple[str, str]:
    """(tensor file, rank record) names of `rank` inside a step dir."""
    return f"rank_{rank:05d}.safetensors", f"rank_{rank:05d}.json"


def _check_int(name: str, value: Any, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")


def _to_json(obj: Any, what: str, indent: int | None = None) -> bytes:
    try:
        return json.dumps(obj, allow_nan=False, indent=indent).encode()
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{what} is not JSON-serializable: {exc}") from exc


class StorageTier:
    """Owns one checkpoint directory: writes rank files, commits steps, verifies and loads.

    `root` is a local path, a `file://` URL (both: a durable local directory) or another
    fsspec URL such as `memory://bucket/ckpt` or `s3://bucket/ckpt`; `self.root` is a Path
    for the former, a path object whose str() is the URL for the latter.

    Safe to use from several processes on one directory as long as each rank saves only
    its own files and one process commits a step. Holds no state beyond its settings.
    """

    def __init__(self, root: str | os.PathLike, keep: int = 3, pace: Callable[[], None] | None = None,
                 run_id: str | None = None) -> None:
        _check_int("keep (number of committed checkpoints to retain)", keep, 1)
        self.root, self._files = open_root(root)
        self.keep = keep
        # Written into every record and manifest; with it set, retention deletes only steps of
        # this run and own_steps() lists them (unbroken.checkpoint.launch_dirs.run_id).
        self.run_id = run_id
        self._pace = pace  # called between the pieces of a tensor file: a background writer's throttle

    # ---- writing -------------------------------------------------------------------

    def save_rank(self, step: int, rank: int, world_size: int, state: dict,
                  meta: dict | None = None) -> dict:
        """Durably write `rank`'s part of `step`; return its {file, bytes, crc32}.

        The tensor file is streamed from the state's tensors (no serialized copy), so they
        must not change until this returns. Raises CheckpointError when the state cannot be
        encoded or written (a full disk, for one); the previous checkpoints are untouched then.
        """
        from unbroken.state.tree import flatten_state  # torch: only where tensors are (not the controller)
        from unbroken.checkpoint.safetensors_stream import SafetensorsStream
        self._check_rank_args(step, rank, world_size)
        tensors, spec = flatten_state(state)
        meta = dict(meta or {})
        _to_json(meta, f"meta of rank {rank} step {step}")  # fail before writing anything
        header = {"format": FORMAT, "step": str(step), "rank": str(rank),
                  "spec": _to_json(spec, "state spec").decode()}
        data = SafetensorsStream(tensors, header, self._pace)
        tensor_name, record_name = rank_file_names(rank)
        step_dir = self._step_dir(step)
        self._refuse_another_runs_step(step)
        try:
            self._files.make_dir(step_dir)
            # Rewriting a step (after resuming from an older one) uncommits it first.
            if self._files.size(step_dir / MANIFEST) is not None:
                logger.info("re-saving step %d: uncommitting %s", step, step_dir / MANIFEST)
                self._files.remove(step_dir / MANIFEST)
            self._files.write_atomic(step_dir / tensor_name, data)
            info = {"file": tensor_name, "bytes": data.nbytes, "crc32": data.crc32}
            record = {"format": FORMAT, "version": VERSION, "step": step, "rank": rank,
                      "world_size": world_size, **info, "created_unix": time.time(),
                      "run_id": self.run_id, "meta": meta, "spec": spec}
            self._files.write_atomic(step_dir / record_name,  # rank done
                                     _to_json(record, f"meta of rank {rank} step {step}"))
        except OSError as exc:
            self._remove_partial(step_dir, (tensor_name, record_name))
            raise self._write_failed(exc, step, f"rank {rank}") from exc
        return info

    def _refuse_another_runs_step(self, step: int) -> None:
        """CheckpointError if `step` is committed by another run (with a run_id set): a run
        never writes over checkpoints it did not write; its own of that step is skipped."""
        if self.run_id is None or self._files.size(self._step_dir(step) / MANIFEST) is None:
            return
        if not self._written_by_this_run(step):
            raise CheckpointError(
                f"not saving step {step}: {self._step_dir(step)} is a committed checkpoint of another "
                "run, kept as it is (this run never writes over or deletes checkpoints it did not "
                "write); its next steps are saved as usual")

    def _remove_partial(self, step_dir: _AnyPath, names: tuple[str, ...]) -> None:
        """After a failed save: remove this rank's files of the step, and the step directory
        once nothing is left in it (other ranks' files are theirs to remove)."""
        for name in names:
            try:
                self._files.remove(step_dir / name)
            except OSError:
                pass
        try:
            if not self._files.list_dir(step_dir):
                self._files.remove_dir(step_dir)
        except OSError:
            pass  # another rank wrote meanwhile, or it is gone already

    def commit(self, step: int, world_size: int, meta: dict | None = None) -> None:
        """Commit `step` once every rank saved: MANIFEST.json, then `latest`, then retention.

        Raises CheckpointError naming the first missing or incomplete rank file.
        """
        _check_int("step", step, 0)
        _check_int("world_size", world_size, 1)
        step_dir = self._step_dir(step)
        ranks = []
        for rank in range(world_size):
            tensor_name, record_name = rank_file_names(rank)
            try:
                record = self._read_record(step, rank)
            except CheckpointCorrupt as exc:
                raise CheckpointError(f"cannot commit step {step}: {exc}") from exc
            if record["world_size"] != world_size:
                raise CheckpointError(
                    f"cannot commit step {step}: {step_dir / record_name} was saved with "
                    f"world_size {record['world_size']}, commit asked for {world_size}")
            found = self._files.size(step_dir / tensor_name)
            if found != record["bytes"]:
                raise CheckpointError(
                    f"cannot commit step {step}: {step_dir / tensor_name} is "
                    f"{'missing' if found is None else f'{found} bytes'}, its record says "
                    f"{record['bytes']} bytes")
            ranks.append({"rank": rank, "file": tensor_name, "bytes": record["bytes"],
                          "crc32": record["crc32"], "record_crc32": record["_crc32"]})
        manifest = {"format": FORMAT, "version": VERSION, "step": step,
                    "world_size": world_size, "ranks": ranks, "created_unix": time.time(),
                    "run_id": self.run_id, "meta": dict(meta or {})}
        _to_json(manifest, f"commit meta of step {step}")  # fail before the checksum
        manifest[MANIFEST_CRC_FIELD] = manifest_crc(manifest)
        manifest_bytes = _to_json(manifest, f"commit meta of step {step}", indent=1)
        try:
            self._files.write_atomic(step_dir / MANIFEST, manifest_bytes)  # commit point
        except OSError as exc:
            try:  # renamed but not durable (directory fsync failed): do not claim a commit
                self._files.remove(step_dir / MANIFEST)
            except OSError:
                pass
            raise self._write_failed(exc, step, "the manifest") from exc
        try:  # `latest` is a hint for people and tools; latest_step() does not depend on it
            self._files.write_atomic(self.root / LATEST, step_dir_name(step).encode())
        except OSError as exc:
            logger.warning("step %d is committed but %s could not be updated: %s",
                           step, self.root / LATEST, exc)
        self._apply_retention()

    def _apply_retention(self) -> None:
        """Delete committed steps beyond `keep`, and incomplete steps older than the newest;
        with a run_id, only steps this run wrote (another run's are the user's data)."""
        committed = [s for s in self.committed_steps() if self._written_by_this_run(s)]
        if not committed:
            return
        doomed = set(committed[self.keep:])
        doomed.update(s for s in self._step_dirs() if s < committed[0] and s not in committed
                      and not self._is_committed(s) and self._written_by_this_run(s))
        for step in sorted(doomed):
            path = self._step_dir(step)
            foreign = [n for n in self._files.list_dir(path) if not _OWN_FILE_RE.match(n)]
            if foreign or not self._files.is_real_dir(path):
                logger.warning("retention: not deleting %s, it holds files unbroken did not "
                               "write: %s", path, foreign or "(not a plain directory)")
                continue
            try:
                self._files.remove(path / MANIFEST)  # uncommit first: no half-deleted step loads
                self._files.remove_tree(path)
            except OSError as exc:
                logger.warning("retention: could not delete %s: %s", path, exc)

    def _written_by_this_run(self, step: int) -> bool:
        """True without a run_id; else when the step's manifest, or all its rank records if it
        has none, carry this run's id."""
        if self.run_id is None:
            return True
        try:
            return self._read_manifest(step).get("run_id") == self.run_id
        except CheckpointCorrupt:
            pass
        names = [n for n in self._files.list_dir(self._step_dir(step)) if re.match(r"^rank_\d{5,}\.json$", n)]
        try:
            return bool(names) and all(
                json.loads(self._files.read_bytes(self._step_dir(step) / n)).get("run_id") == self.run_id
                for n in names)
        except (OSError, ValueError, AttributeError):
            return False

    def own_steps(self, steps: list[int]) -> list[int]:
        """The steps of `steps` this run committed (all of them without a run_id)."""
        return [s for s in steps if self._written_by_this_run(s)]

    # ---- reading -------------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        """Steps with a parseable MANIFEST.json of our format, newest first."""
        return [s for s in sorted(self._step_dirs(), reverse=True) if self._is_committed(s)]

    def latest_step(self) -> int | None:
        """The step named by `latest` if committed, else the newest committed step."""
        try:
            name = self._files.read_bytes(self.root / LATEST).decode().strip()
        except (OSError, UnicodeDecodeError):
            name = ""
        match = _STEP_RE.match(name)
        if match and self._is_committed(int(match.group(1))):
            return int(match.group(1))
        committed = self.committed_steps()
        return committed[0] if committed else None

    def verify_rank(self, step: int, rank: int) -> None:
        """Raise CheckpointCorrupt, naming the file and the problem, unless `rank` of `step`
        is committed and its file's size and crc32 match the manifest."""
        path, entry, record = self._check_metadata(step, rank)
        check_bytes(path, entry, found_bytes=self._files.size(path),
                          crc=lambda: self._files.crc32(path))
        with self._files.open_read(path) as f:
            missing = sorted(record["_names"] - safetensors_names(f, path))
        if missing:
            raise CheckpointCorrupt(f"{self._step_dir(step) / rank_file_names(rank)[1]}: names "
                                    f"tensor(s) {missing[:5]} that {path.name} does not hold")

    def load_rank(self, step: int, rank: int) -> tuple[Any, dict]:
        """Verify, then return (state tree, meta saved with it). Nothing is returned half-way."""
        import safetensors.torch  # torch: only where tensors are (not the controller)
        from unbroken.state.tree import unflatten_state
        path, entry, record = self._check_metadata(step, rank)
        try:
            data = self._files.read_bytes(path)
        except OSError as exc:
            raise CheckpointCorrupt(f"{path}: cannot read ({exc})") from exc
        check_bytes(path, entry, found_bytes=len(data), crc=lambda: zlib.crc32(data))
        try:
            tensors = safetensors.torch.load(data)
            state = unflatten_state(tensors, record["spec"])
        except CheckpointCorrupt as exc:
            raise CheckpointCorrupt(f"{path}: {exc}") from exc
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointCorrupt(f"{path}: not a readable safetensors file ({exc})") from exc
        return state, record.get("meta") or {}

    def verify_step(self, step: int) -> list[str]:
        """Every problem found in `step` (all ranks); empty when it is fine."""
        try:
            manifest = self._read_manifest(step)
        except CheckpointCorrupt as exc:
            return [str(exc)]
        problems = []
        for rank in range(manifest["world_size"]):
            try:
                self.verify_rank(step, rank)
            except CheckpointCorrupt as exc:
                problems.append(str(exc))
        return problems

    def newest_loadable_step(self, rank: int, at_or_below: int | None = None) -> int | None:
        """Newest committed step (<= at_or_below) whose file for `rank` verifies.

        Each skipped step (bad data, or a MANIFEST.json that is not ours) gets one warning.
        """
        return next(self._steps_passing(rank, at_or_below, self.verify_rank), None)

    def loadable_steps(self, rank: int, at_or_below: int | None = None) -> list[int]:
        """Committed steps (<= at_or_below), newest first, whose file for `rank` is in place:
        the manifest and the rank record agree on it and it has the size they list.

        Cheap: no tensor data is read, so a file whose bytes rotted in place is listed here
        and fails its crc32 in :meth:`load_rank`. Each skipped step gets one warning.
        """
        return list(self._steps_passing(rank, at_or_below, self._check_in_place))

    def _steps_passing(self, rank: int, at_or_below: int | None,
                       check: Callable[[int, int], None]) -> Iterator[int]:
        """Committed steps (<= at_or_below), newest first, for which ``check(step, rank)`` passes."""
        for step in sorted(self._step_dirs(), reverse=True):
            if (at_or_below is not None and step > at_or_below) \
                    or self._files.size(self._step_dir(step) / MANIFEST) is None:
                continue  # above the bound, or never committed: not a candidate, not a fault
            try:
                check(step, rank)
            except CheckpointCorrupt as exc:
                logger.warning("skipping checkpoint step %d for rank %d: %s", step, rank, exc)
                continue
            yield step

    def _check_in_place(self, step: int, rank: int) -> None:
        path, entry, _ = self._check_metadata(step, rank)
        found = self._files.size(path)
        if found != entry["bytes"]:
            raise CheckpointCorrupt(f"{path}: {'missing' if found is None else f'{found} bytes'}, "
                                    f"the manifest lists {entry['bytes']} bytes")

    # ---- helpers -------------------------------------------------------------------

    def _step_dir(self, step: int) -> _AnyPath:
        return self.root / step_dir_name(step)

    def _step_dirs(self) -> list[int]:
        """Steps that have a `step_XXXXXXXX` directory of our naming (unsorted)."""
        steps = []
        for name in self._files.list_dir(self.root):
            match = _STEP_RE.match(name)
            # step_dir_name() must round-trip, so "step_000000030" is not ours
            if match and step_dir_name(int(match.group(1))) == name \
                    and self._files.is_real_dir(self.root / name):
                steps.append(int(match.group(1)))
        return steps

    def _is_committed(self, step: int) -> bool:
        try:
            self._read_manifest(step)
            return True
        except CheckpointCorrupt:
            return False

    def _read_json(self, path: _AnyPath, kind: str) -> dict:
        """Parse one of our JSON files; CheckpointCorrupt naming the path if it is not ours.
        The crc32 of its bytes is added as `_crc32`."""
        try:
            raw = self._files.read_bytes(path)
            obj = json.loads(raw)
        except FileNotFoundError as exc:
            raise CheckpointCorrupt(f"{path}: missing ({kind})") from exc
        except (OSError, ValueError) as exc:
            raise CheckpointCorrupt(f"{path}: unreadable {kind} ({exc})") from exc
        check_format(obj, path, kind, FORMAT, _READABLE_VERSIONS)
        obj["_crc32"] = zlib.crc32(raw)
        return obj

    def _read_manifest(self, step: int) -> dict:
        path = self._step_dir(step) / MANIFEST
        manifest = self._read_json(path, "manifest, so the step is not committed")
        del manifest["_crc32"]
        check_manifest(manifest, path, step, lambda rank: rank_file_names(rank)[0])
        return manifest

    def _read_record(self, step: int, rank: int) -> dict:
        path = self._step_dir(step) / rank_file_names(rank)[1]
        record = self._read_json(path, f"record of rank {rank}")
        record["_names"] = check_record(record, path, step, rank)
        return record

    def _check_metadata(self, step: int, rank: int) -> tuple[_AnyPath, dict, dict]:
        """Manifest and rank record agree on `rank`; return (tensor path, entry, record)."""
        manifest = self._read_manifest(step)
        if not 0 <= rank < manifest["world_size"]:
            raise CheckpointCorrupt(f"{self._step_dir(step) / MANIFEST}: step {step} has "
                                    f"world_size {manifest['world_size']}, no rank {rank}")
        entry = manifest["ranks"][rank]
        record = self._read_record(step, rank)
        path = self._step_dir(step) / entry["file"]
        check_agreement(entry, record, path, self._step_dir(step) / rank_file_names(rank)[1])
        return path, entry, record

    def _check_rank_args(self, step: int, rank: int, world_size: int) -> None:
        _check_int("step", step, 0)
        _check_int("world_size", world_size, 1)
        _check_int("rank", rank, 0)
        if rank >= world_size:
            raise ConfigError(f"rank {rank} is out of range for world_size {world_size}")

    def _write_failed(self, exc: OSError, step: int, what: str) -> CheckpointError:
        cause = errno.errorcode.get(exc.errno, f"errno {exc.errno}") if exc.errno else type(exc).__name__
        hint = " (the disk is full)" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        where = f" writing {exc.filename}" if exc.filename else ""
        return CheckpointError(
            f"saving step {step} ({what}) to {self.root} failed{where}: {exc.strerror or exc} "
            f"({cause}){hint}; what it wrote is removed, the step is not committed and earlier "
            f"checkpoints are kept. Free space in {self.root} or save elsewhere (--save).")


def describe(root: str | os.PathLike) -> list[dict]:
    """One dict per step dir in `root`, newest first: step, committed, world_size,
    ranks (rank numbers with a rank record), bytes (total size of the dir's files)."""
    tier = StorageTier(root)
    files = tier._files
    out = []
    for step in sorted(tier._step_dirs(), reverse=True):
        path = tier._step_dir(step)
        names = files.list_dir(path)
        ranks = sorted(int(m.group(1)) for n in names if (m := re.match(r"^rank_(\d{5,})\.json$", n)))
        try:
            world_size, committed = tier._read_manifest(step)["world_size"], True
        except CheckpointCorrupt:
            world_size, committed = None, False
            for rank in ranks:  # uncommitted: take world_size from any readable record
                try:
                    world_size = tier._read_record(step, rank)["world_size"]
                    break
                except CheckpointCorrupt:
                    continue
        total = sum(files.size(path / n) or 0 for n in names)
        out.append({"step": step, "committed": committed, "world_size": world_size,
                    "ranks": ranks, "bytes": total})
    return out
