"""Storage tier of the checkpoint engine: durable, checksummed, committed-by-manifest steps.

`root` is a local directory (a path or a `file://` URL) or any fsspec URL (`memory://`,
`s3://`, `gs://`, ... with that protocol's fsspec plugin installed). Layout under `root`:

    root/step_00000030/rank_00000.safetensors  tensors (header metadata carries the spec too)
    root/step_00000030/rank_00000.json         rank record: step, rank, spec, bytes, crc32, meta
    root/step_00000030/MANIFEST.json           written LAST: the only commit point
    root/latest                                "step_00000030", replaced atomically

Every file is written to a temporary name in its final directory, fsynced, renamed, and
the directory fsynced, so a crash or a full disk leaves either the old file or the new one.
Object stores have no atomic rename or fsync: there a file is a temporary object moved to
its final name, which is still all-or-nothing per object. A step is committed iff its
MANIFEST.json (written last) parses and is ours; nothing is ever loaded before its size and
crc32 match the manifest.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import zlib
from typing import Any, Callable, Iterator

import safetensors.torch

from unbroken.checkpoint.codec import flatten_state, unflatten_state
from unbroken.checkpoint.files import _AnyPath, open_root
from unbroken.checkpoint.safetensors_stream import SafetensorsStream
from unbroken.errors import CheckpointCorrupt, CheckpointError, ConfigError

logger = logging.getLogger(__name__)

FORMAT = "unbroken-checkpoint"
VERSION = 1
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


def _require(obj: Any, path: _AnyPath, kind: str, **types: type) -> None:
    """CheckpointCorrupt naming `path` unless `obj` is a dict whose fields have `types`."""
    for key, expected in types.items():
        value = obj.get(key) if isinstance(obj, dict) else None
        if type(value) is not expected:
            raise CheckpointCorrupt(f"{path}: malformed {kind}: field {key!r} should be "
                                    f"{expected.__name__}, found {type(value).__name__}")


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

    def __init__(self, root: str | os.PathLike, keep: int = 3, pace: Callable[[], None] | None = None) -> None:
        _check_int("keep (number of committed checkpoints to retain)", keep, 1)
        self.root, self._files = open_root(root)
        self.keep = keep
        self._pace = pace  # called between the pieces of a tensor file: a background writer's throttle

    # ---- writing -------------------------------------------------------------------

    def save_rank(self, step: int, rank: int, world_size: int, state: dict,
                  meta: dict | None = None) -> dict:
        """Durably write `rank`'s part of `step`; return its {file, bytes, crc32}.

        The tensor file is streamed from the state's tensors (no serialized copy), so they
        must not change until this returns. Raises CheckpointError when the state cannot be
        encoded or written (a full disk, for one); the previous checkpoints are untouched then.
        """
        self._check_rank_args(step, rank, world_size)
        tensors, spec = flatten_state(state)
        meta = dict(meta or {})
        _to_json(meta, f"meta of rank {rank} step {step}")  # fail before writing anything
        header = {"format": FORMAT, "step": str(step), "rank": str(rank),
                  "spec": _to_json(spec, "state spec").decode()}
        data = SafetensorsStream(tensors, header, self._pace)
        tensor_name, record_name = rank_file_names(rank)
        step_dir = self._step_dir(step)
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
                      "meta": meta, "spec": spec}
            self._files.write_atomic(step_dir / record_name,  # rank done
                                     _to_json(record, f"meta of rank {rank} step {step}"))
        except OSError as exc:
            raise self._write_failed(exc, step, f"rank {rank}") from exc
        return info

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
                          "crc32": record["crc32"]})
        manifest = {"format": FORMAT, "version": VERSION, "step": step,
                    "world_size": world_size, "ranks": ranks, "created_unix": time.time(),
                    "meta": dict(meta or {})}
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
        """Delete committed steps beyond `keep`, and incomplete steps older than the newest."""
        committed = self.committed_steps()
        if not committed:
            return
        doomed = set(committed[self.keep:])
        doomed.update(s for s in self._step_dirs() if s < committed[0] and s not in committed)
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
        path, entry, _ = self._check_metadata(step, rank)
        self._check_bytes(path, entry, found_bytes=self._files.size(path),
                          crc=lambda: self._files.crc32(path))

    def load_rank(self, step: int, rank: int) -> tuple[Any, dict]:
        """Verify, then return (state tree, meta saved with it). Nothing is returned half-way."""
        path, entry, record = self._check_metadata(step, rank)
        try:
            data = self._files.read_bytes(path)
        except OSError as exc:
            raise CheckpointCorrupt(f"{path}: cannot read ({exc})") from exc
        self._check_bytes(path, entry, found_bytes=len(data), crc=lambda: zlib.crc32(data))
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
        """Parse one of our JSON files; CheckpointCorrupt naming the path if it is not ours."""
        try:
            obj = json.loads(self._files.read_bytes(path))
        except FileNotFoundError as exc:
            raise CheckpointCorrupt(f"{path}: missing ({kind})") from exc
        except (OSError, ValueError) as exc:
            raise CheckpointCorrupt(f"{path}: unreadable {kind} ({exc})") from exc
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            found = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
            raise CheckpointCorrupt(f"{path}: not an unbroken checkpoint (format {found!r}, "
                                    f"expected {FORMAT!r})")
        if obj.get("version") != VERSION:
            raise CheckpointCorrupt(f"{path}: unsupported {kind} version {obj.get('version')!r} "
                                    f"(this unbroken reads version {VERSION})")
        return obj

    def _read_manifest(self, step: int) -> dict:
        path = self._step_dir(step) / MANIFEST
        manifest = self._read_json(path, "manifest, so the step is not committed")
        _require(manifest, path, "manifest", step=int, world_size=int, ranks=list)
        if manifest["step"] != step or len(manifest["ranks"]) != manifest["world_size"]:
            raise CheckpointCorrupt(f"{path}: malformed manifest (step {manifest['step']}, "
                                    f"{len(manifest['ranks'])} ranks for world_size "
                                    f"{manifest['world_size']}; expected step {step})")
        for rank, entry in enumerate(manifest["ranks"]):
            _require(entry, path, f"manifest entry {rank}", rank=int, file=str, bytes=int,
                     crc32=int)
            if entry["rank"] != rank or entry["file"] != rank_file_names(rank)[0]:
                raise CheckpointCorrupt(f"{path}: malformed manifest entry {rank}: {entry}")
        return manifest

    def _read_record(self, step: int, rank: int) -> dict:
        path = self._step_dir(step) / rank_file_names(rank)[1]
        record = self._read_json(path, f"record of rank {rank}")
        _require(record, path, "rank record", step=int, rank=int, world_size=int, file=str,
                 bytes=int, crc32=int, spec=dict)
        if (record["step"], record["rank"]) != (step, rank):
            raise CheckpointCorrupt(f"{path}: describes rank {record['rank']} of step "
                                    f"{record['step']}, expected rank {rank} of step {step}")
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
        if (record["file"], record["bytes"], record["crc32"]) != \
                (entry["file"], entry["bytes"], entry["crc32"]):
            raise CheckpointCorrupt(f"{path}: rank record {rank_file_names(rank)[1]} disagrees "
                                    f"with {MANIFEST} (file, bytes or crc32)")
        return path, entry, record

    @staticmethod
    def _check_bytes(path: _AnyPath, entry: dict, found_bytes: int | None, crc) -> None:
        expected = entry["bytes"]
        if found_bytes is None:
            raise CheckpointCorrupt(f"{path}: missing (the manifest lists {expected} bytes)")
        if found_bytes != expected:
            what = "truncated" if found_bytes < expected else "wrong size"
            raise CheckpointCorrupt(f"{path}: {what}: expected {expected} bytes, found {found_bytes}")
        got = crc()
        if got != entry["crc32"]:
            raise CheckpointCorrupt(
                f"{path}: crc32 mismatch: expected {entry['crc32']:#010x}, got {got:#010x}")

    def _check_rank_args(self, step: int, rank: int, world_size: int) -> None:
        _check_int("step", step, 0)
        _check_int("world_size", world_size, 1)
        _check_int("rank", rank, 0)
        if rank >= world_size:
            raise ConfigError(f"rank {rank} is out of range for world_size {world_size}")

    def _write_failed(self, exc: OSError, step: int, what: str) -> CheckpointError:
        return CheckpointError(
            f"saving step {step} ({what}) to {self.root} failed: {exc.strerror or exc} "
            f"(errno {exc.errno}, file {exc.filename or '?'}); the step is not committed and "
            "earlier checkpoints are kept. Free space there or lower the `keep` setting.")


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
