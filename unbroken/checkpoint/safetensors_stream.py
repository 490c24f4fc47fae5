"""A safetensors file as a stream of buffers, written straight from the tensors with its
crc32 computed on the way (the storage tier's writer, :mod:`unbroken.checkpoint.storage`).

Runs in whichever thread writes (the worker's, or the agent's persister).
"""

from __future__ import annotations

import ctypes
import json
import struct
import zlib
from typing import Any, Callable, Iterator

import torch

from unbroken.errors import CheckpointError
from unbroken.state.dtypes import SAFETENSORS_NAMES

_CHUNK_BYTES = 4 << 20


class SafetensorsStream:
    """A safetensors file as the buffers to write in turn: its header, then each tensor's
    bytes in _CHUNK_BYTES pieces read straight from the tensor; `crc32` of all of it is
    complete once they were all taken (each piece is checksummed while still in cache).

    The same bytes safetensors.torch.save makes, but for the order of the tensors (here by
    element size, then name, so each starts aligned) and of the header's keys.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                 pace: Callable[[], None] | None = None) -> None:
        self._pace = pace
        order = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
        index: dict[str, Any] = {"__metadata__": metadata}
        offset = 0
        for name, t in order:
            if t.dtype not in SAFETENSORS_NAMES:  # flatten_state emits only these
                raise CheckpointError(f"tensor {name!r} has dtype {t.dtype}, which safetensors "
                                      "cannot store")
            nbytes = t.numel() * t.element_size()
            index[name] = {"dtype": SAFETENSORS_NAMES[t.dtype], "shape": list(t.shape),
                           "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        head = json.dumps(index, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)  # the tensor bytes start 8-byte aligned
        self.header = struct.pack("<Q", len(head)) + head
        self.tensors = [t for _, t in order]
        self.nbytes, self.crc32 = len(self.header) + offset, 0

    def __iter__(self) -> Iterator[memoryview | bytes]:
        self.crc32 = zlib.crc32(self.header)
        yield self.header
        for t in self.tensors:  # CPU and contiguous: flatten_state made them so
            nbytes = t.numel() * t.element_size()
            if not nbytes:
                continue
            view = memoryview((ctypes.c_ubyte * nbytes).from_address(t.data_ptr())).cast("B")
            for a in range(0, nbytes, _CHUNK_BYTES):
                piece = view[a:a + _CHUNK_BYTES]
                self.crc32 = zlib.crc32(piece, self.crc32)
                yield piece
                if self._pace is not None:
                    self._pace()
