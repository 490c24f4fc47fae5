"""Checks that cover every file of a storage step, beyond the tensor file's crc32.

A step's MANIFEST.json lists, per rank, the crc32 of the tensor file and of the rank record
(rank_NNNNN.json: structure, step, meta such as the scheduler's `base_lrs`), and carries a
crc32 of itself; the tensor names a record's spec refers to must be plain names and must be
in that rank's tensor file. Pure functions over bytes and parsed JSON, used by StorageTier.
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from typing import IO, Any

from unbroken.errors import CheckpointCorrupt

MANIFEST_CRC_FIELD = "manifest_crc32"
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on its JSON header
_MAX_NAME_CHARS = 4096
_BAD_NAME_RE = re.compile(r"[\x00-\x1f\x7f\\]")


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


def is_plain_name(name: Any) -> bool:
    """A tensor name we write: a non-empty str of "/"-joined parts, none empty, "." or "..",
    no control characters or backslashes."""
    return (isinstance(name, str) and 0 < len(name) <= _MAX_NAME_CHARS and not _BAD_NAME_RE.search(name)
            and all(part not in ("", ".", "..") for part in name.split("/")))


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
