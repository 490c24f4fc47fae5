"""Checks that cover every file of a storage step, beyond the tensor file's crc32.

A step's MANIFEST.json lists, per rank, the crc32 of the tensor file and of the rank record
(rank_NNNNN.json: structure, step, meta such as the scheduler's `base_lrs`), and carries a
crc32 of itself; the tensor names a record's spec refers to must be plain names and must be
in that rank's tensor file; the manifest, each record and their agreement are well-formed.
Pure functions over bytes and parsed JSON, used by StorageTier.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import IO, Any, Callable

from unbroken.errors import CheckpointCorrupt
from unbroken.state.spec import is_plain_name

MANIFEST_CRC_FIELD = "manifest_crc32"
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on its JSON header


def manifest_crc(manifest: dict) -> int:
    """crc32 of `manifest` without its own checksum field, in a canonical JSON form."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_CRC_FIELD}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode())


def check_manifest_crc(manifest: dict, path: Any) -> None:
    """CheckpointCorrupt naming `path` unless the manifest's own checksum matches."""
    recorded = manifest.get(MANIFEST_CRC_FIELD)
    if type(recorded) is not int:
        raise CheckpointCorrupt(f"{path}: malformed manifest: field {MANIFEST_CRC_FIELD!r} should be int")
    got = manifest_crc(manifest)
    if got != recorded:
        raise CheckpointCorrupt(f"{path}: crc32 mismatch: the manifest was changed after it was "
                                f"written (expected {recorded:#010x}, got {got:#010x})")


def spec_tensor_names(spec: Any, path: Any) -> set[str]:
    """The tensor names a flatten_state spec refers to; CheckpointCorrupt naming `path` if
    one is not a plain name. Iterative: a deeply nested spec cannot exhaust the stack."""
    names, todo = set(), [spec]
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
        elif isinstance(node, dict):
            if node.get("t") in ("tensor", "ndarray") and "k" in node:
                if not is_plain_name(node["k"]):
                    raise CheckpointCorrupt(f"{path}: tensor name {node['k']!r} is not allowed (names are "
                                            "'/'-joined parts, none empty, '.' or '..', no control "
                                            "characters)")
                names.add(node["k"])
            todo.extend(node.values())
    return names


def safetensors_names(f: IO[bytes], path: Any) -> set[str]:
    """The tensor names in the header of the safetensors file open as `f`."""
    try:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > _MAX_HEADER_BYTES:
            raise ValueError(f"header length {header_len} is implausible")
        header = json.loads(f.read(header_len))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError, struct.error) as exc:
        raise CheckpointCorrupt(f"{path}: unreadable safetensors header ({exc})") from exc
    return {name for name in header if name != "__metadata__"}


def check_format(obj: Any, path: Any, kind: str, fmt: str, versions: tuple[int, ...]) -> None:
    """CheckpointCorrupt naming `path` unless the parsed `obj` is a dict of format `fmt` and
    one of `versions`."""
    if not isinstance(obj, dict) or obj.get("format") != fmt:
        found = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
        raise CheckpointCorrupt(f"{path}: not an unbroken checkpoint (format {found!r}, expected {fmt!r})")
    if obj.get("version") not in versions:
        raise CheckpointCorrupt(f"{path}: unsupported {kind} version {obj.get('version')!r} "
                                f"(this unbroken reads versions {versions})")


def check_manifest(manifest: dict, path: Any, step: int, tensor_file: Callable[[int], str]) -> None:
    """CheckpointCorrupt naming `path` unless the parsed `manifest` is one of `step`, with one
    well-formed entry per rank naming ``tensor_file(rank)``, and (version 2) its own checksum matches."""
    require_fields(manifest, path, "manifest", step=int, world_size=int, ranks=list)
    if manifest["version"] >= 2:
        check_manifest_crc(manifest, path)
    if manifest["step"] != step or len(manifest["ranks"]) != manifest["world_size"]:
        raise CheckpointCorrupt(f"{path}: malformed manifest (step {manifest['step']}, "
                                f"{len(manifest['ranks'])} ranks for world_size "
                                f"{manifest['world_size']}; expected step {step})")
    for rank, entry in enumerate(manifest["ranks"]):
        require_fields(entry, path, f"manifest entry {rank}", rank=int, file=str, bytes=int,
                       crc32=int, **({"record_crc32": int} if manifest["version"] >= 2 else {}))
        if entry["rank"] != rank or entry["file"] != tensor_file(rank):
            raise CheckpointCorrupt(f"{path}: malformed manifest entry {rank}: {entry}")


def check_record(record: dict, path: Any, step: int, rank: int) -> set[str]:
    """The tensor names of the parsed rank `record` of `rank` in `step`; CheckpointCorrupt
    naming `path` if it is malformed or describes another rank or step."""
    require_fields(record, path, "rank record", step=int, rank=int, world_size=int, file=str,
                   bytes=int, crc32=int, spec=dict)
    if (record["step"], record["rank"]) != (step, rank):
        raise CheckpointCorrupt(f"{path}: describes rank {record['rank']} of step "
                                f"{record['step']}, expected rank {rank} of step {step}")
    return spec_tensor_names(record["spec"], path)


def check_agreement(entry: dict, record: dict, tensor_path: Any, record_path: Any) -> None:
    """CheckpointCorrupt unless the manifest `entry` of a rank and its `record` (with `_crc32`,
    the crc32 of its bytes) agree: the record's checksum (version 2), file, bytes and crc32."""
    if "record_crc32" in entry and record["_crc32"] != entry["record_crc32"]:
        raise CheckpointCorrupt(
            f"{record_path}: crc32 mismatch: expected {entry['record_crc32']:#010x}, got "
            f"{record['_crc32']:#010x} (the rank record was changed after the commit)")
    if (record["file"], record["bytes"], record["crc32"]) != (entry["file"], entry["bytes"], entry["crc32"]):
        raise CheckpointCorrupt(f"{tensor_path}: rank record {record_path.name} disagrees "
                                "with MANIFEST.json (file, bytes or crc32)")


def check_bytes(path: Any, entry: dict, found_bytes: int | None, crc: Callable[[], int]) -> None:
    """CheckpointCorrupt naming `path` unless `found_bytes` and then ``crc()`` match the manifest `entry`."""
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


def require_fields(obj: Any, path: Any, kind: str, **types: type) -> None:
    """CheckpointCorrupt naming `path` unless `obj` is a dict whose fields have `types`."""
    for key, expected in types.items():
        value = obj.get(key) if isinstance(obj, dict) else None
        if type(value) is not expected:
            raise CheckpointCorrupt(f"{path}: malformed {kind}: field {key!r} should be "
                                    f"{expected.__name__}, found {type(value).__name__}")
