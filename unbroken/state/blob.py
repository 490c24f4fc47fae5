"""A rank's own state as one self-describing blob of bytes (never pickle).

The per-rank state (RNG streams and per-rank objects, see :mod:`unbroken.worker.rollback`)
travels to the controller every step and back to a replacement in its regroup order, so it
is encoded and decoded here, fast:

* format 2: ``b"UBS2"`` then one msgpack document; tensors, tuples, ordered dicts,
  ``torch.Size`` and numpy values are msgpack extension types whose payload is another such
  document (a tensor's: a small binary header, dtype and shape, then its raw bytes). Encoding is C code: ~10x faster than
  walking the tree in Python for the small trees of one rank.
* format 1 (what msgpack cannot hold, e.g. an int over 64 bits): an 8-byte length, a JSON
  header (the state tree's spec, :mod:`unbroken.state.tree`, and a table of the tensors), the
  tensors' raw bytes.

The two cannot be confused: format 1's first 8 bytes are a length far below ``b"UBS2"`` read
as a number. The tree must hold what the state tree takes (the caller checks it, e.g.
:func:`~unbroken.worker.rollback.snapshot`). Pure functions; any thread.
"""

from __future__ import annotations

import ctypes
import json
import struct
import sys
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import msgpack
import torch

from unbroken.errors import CheckpointCorrupt, CheckpointError
from unbroken.state.dtypes import dtype_name, dtype_named
from unbroken.state.tree import flatten_state, unflatten_state

_MAGIC = b"UBS2"
_FORMAT_1 = "unbroken-state-blob-1"
_TENSOR, _TUPLE, _ORDERED, _SIZE, _NDARRAY, _NP_SCALAR = range(1, 7)  # msgpack extension codes


def raw_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a tensor's elements in row-major order (a device tensor's through a host copy)."""
    if not t.is_cpu:
        t = t.detach().cpu()
    if t.is_contiguous() and not t.is_conj() and not t.is_neg():  # most tensors: one copy of their memory
        size = t.nbytes
        return ctypes.string_at(t.data_ptr(), size) if size else b""
    try:
        return t.numpy().tobytes()  # most tensors: one call
    except (RuntimeError, TypeError):  # needs grad, a conj/neg view, a dtype numpy lacks (bf16, ...)
        t = t.detach().resolve_conj().resolve_neg().contiguous()
        return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


# -- encoding --------------------------------------------------------------------------------
def encode_tree(tree: Any) -> bytes:
    """``tree`` (tensors and plain values) as one blob; CheckpointError for a value it cannot hold."""
    return TreeEncoder().encode(tree)


class TreeEncoder:
    """Encodes trees one after another (format 2, see the module docstring), as fast as the
    per-step reports need: one msgpack packer kept for every call, each tensor header (dtype
    and shape) made once, and the encodings of tensors the caller knows never change reused.

    ``cpu_only``: a tensor on another device is a value it cannot hold (CheckpointError), for
    callers that keep such tensors on their device instead.

    Owned by one rank's :class:`~unbroken.worker.rollback.StepStates`; one thread at a time.
    """

    def __init__(self, cpu_only: bool = False) -> None:
        self._cpu_only = cpu_only
        self._packer = msgpack.Packer(use_bin_type=True, strict_types=True, default=self._extension)
        self._headers: dict[tuple[torch.dtype, torch.Size], bytes] = {}
        self._memo: dict[int, tuple[torch.Tensor, msgpack.ExtType]] = {}  # id -> (tensor, encoding)
        self._seen: dict[int, tuple[torch.Tensor, msgpack.ExtType]] = {}

    def encode(self, tree: Any, unchanging: Iterable[torch.Tensor] = ()) -> bytes:
        """``tree`` as one blob (CheckpointError for a value it cannot hold). ``unchanging``: tensors
        of ``tree`` the caller never changes; a later call meeting the same object reuses its encoding."""
        self._seen = {}
        try:
            blob = _MAGIC + self._packer.pack(tree)
        except OverflowError as exc:  # an int msgpack cannot hold: the JSON format keeps any int
            self._packer.reset()
            if self._cpu_only:  # (format 1 would bring device tensors to the host)
                raise CheckpointError(f"cannot encode the state in format 2: {exc}") from exc
            blob = _encode_format_1(tree)
        except (TypeError, ValueError) as exc:
            self._packer.reset()
            raise CheckpointError(f"cannot encode the per-rank state: {exc}") from exc
        seen = self._seen
        self._memo = {id(t): seen[id(t)] for t in unchanging if id(t) in seen}
        return blob

    def _pack_nested(self, value: Any) -> bytes:
        """An extension's payload: packed by a packer of its own (the kept one is mid-document)."""
        return msgpack.packb(value, use_bin_type=True, strict_types=True, default=self._extension)

    def _extension(self, x: Any) -> msgpack.ExtType:
        kind = type(x)
        if isinstance(x, torch.Tensor):
            known = self._memo.get(id(x))
            extension = known[1] if known is not None and known[0] is x else self._tensor_extension(x)
            self._seen[id(x)] = (x, extension)
            return extension
        if kind is int:
            raise OverflowError(f"{x} does not fit 64 bits")  # encode falls back to format 1
        if kind is tuple:
            return msgpack.ExtType(_TUPLE, self._pack_nested(list(x)))
        if kind is OrderedDict:
            return msgpack.ExtType(_ORDERED, self._pack_nested([[[k, v] for k, v in x.items()],
                                                                getattr(x, "_metadata", None)]))
        if kind is torch.Size:
            return msgpack.ExtType(_SIZE, self._pack_nested(list(x)))
        np = sys.modules.get("numpy")  # a numpy object implies numpy is already imported
        if np is not None and isinstance(x, np.ndarray) and not x.dtype.hasobject:
            return msgpack.ExtType(_NDARRAY, self._pack_nested([x.dtype.str, list(x.shape),
                                                                np.ascontiguousarray(x).tobytes()]))
        if np is not None and isinstance(x, np.generic) and not x.dtype.hasobject:
            return msgpack.ExtType(_NP_SCALAR, self._pack_nested([x.dtype.str, x.tobytes()]))
        raise TypeError(f"type {kind.__module__}.{kind.__qualname__} is not supported")

    def _tensor_extension(self, x: torch.Tensor) -> msgpack.ExtType:
        """[name length, ndim] bytes, the dtype's name, ndim little-endian int64 sizes, the raw bytes."""
        if not x.is_cpu and self._cpu_only:
            raise TypeError(f"a tensor on {x.device} (this encoder keeps CPU tensors only)")
        t = x if x.is_cpu else x.detach().cpu()
        key = (t.dtype, t.shape)
        header = self._headers.get(key)
        if header is None:
            header = self._headers[key] = _tensor_header(*key)
        return _new_extension(msgpack.ExtType, (_TENSOR, header + raw_bytes(t)))


#: ``ExtType(code, data)`` without its argument checks (ours are right by construction): the
#: constructor is a Python function, and the per-step reports make one for every new tensor.
_new_extension = tuple.__new__


def _tensor_header(dtype: torch.dtype, shape: torch.Size) -> bytes:
    name = dtype_name(dtype).encode()
    return bytes((len(name), len(shape))) + name + struct.pack(f"<{len(shape)}q", *shape)


def _encode_format_1(tree: Any) -> bytes:
    tensors, spec = flatten_state(tree)
    table, parts = [], []
    for name, t in tensors.items():
        raw = raw_bytes(t)
        table.append([name, dtype_name(t.dtype), list(t.shape), len(raw)])
        parts.append(raw)
    header = json.dumps({"format": _FORMAT_1, "spec": spec, "tensors": table}).encode()
    return len(header).to_bytes(8, "little") + header + b"".join(parts)


# -- decoding --------------------------------------------------------------------------------
def decode_tree(data: bytes, what: str) -> Any:
    """The tree :func:`encode_tree` made; CheckpointCorrupt naming ``what`` if it is not one."""
    try:
        if data[:len(_MAGIC)] == _MAGIC:
            return _unpack(data[len(_MAGIC):])
        tensors, spec = _read_format_1(data)
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError, IndexError,
            msgpack.UnpackException) as exc:
        raise CheckpointCorrupt(f"{what}: not an encoded state ({type(exc).__name__}: {exc})") from exc
    return unflatten_state(tensors, spec)


def _unpack(payload: bytes) -> Any:
    return msgpack.unpackb(payload, raw=False, strict_map_key=False, ext_hook=_from_extension,
                           max_ext_len=len(payload), max_bin_len=len(payload))


def _from_extension(code: int, payload: bytes) -> Any:
    if code == _TENSOR:
        return _tensor_from(payload)
    value = _unpack(payload)
    if code == _TUPLE:
        return tuple(value)
    if code == _ORDERED:
        items, metadata = value
        out = OrderedDict((key, item) for key, item in items)
        if metadata is not None:
            out._metadata = metadata  # type: ignore[attr-defined]
        return out
    if code == _SIZE:
        return torch.Size(value)
    if code in (_NDARRAY, _NP_SCALAR):
        return _numpy(code, value)
    raise ValueError(f"unknown extension type {code}")


def _tensor_from(payload: bytes) -> torch.Tensor:
    """The tensor of a :func:`_tensor_extension` payload."""
    name_len, ndim = payload[0], payload[1]
    shape_at = 2 + name_len
    raw_at = shape_at + 8 * ndim
    if raw_at > len(payload):
        raise ValueError(f"a tensor header of {raw_at} bytes in {len(payload)}")
    shape = list(struct.unpack_from(f"<{ndim}q", payload, shape_at))
    return _tensor(payload[2:shape_at].decode("ascii"), shape, payload[raw_at:])


def _tensor(name: Any, shape: Any, raw: Any) -> torch.Tensor:
    dtype = dtype_named(str(name))
    if dtype is None:
        raise ValueError(f"{name!r} is not a torch dtype")
    numel = 1
    for size in shape:
        if type(size) is not int or size < 0:
            raise ValueError(f"shape {shape!r} is not a list of sizes")
        numel *= size
    if not isinstance(raw, bytes) or len(raw) != numel * dtype.itemsize:
        raise ValueError(f"{len(raw) if isinstance(raw, bytes) else type(raw).__name__} bytes for shape "
                         f"{shape} of {name}")
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def _numpy(code: int, value: list) -> Any:
    try:
        import numpy as np
    except ImportError as exc:
        raise CheckpointError("the per-rank state holds a numpy value; install numpy to load it") from exc
    dtype = np.dtype(value[0])
    if dtype.hasobject:
        raise ValueError(f"numpy dtype {dtype} holds python objects")
    if code == _NP_SCALAR:
        return np.frombuffer(value[1], dtype=dtype)[0]
    _, shape, raw = value
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def _read_format_1(data: bytes) -> tuple[dict[str, torch.Tensor], dict]:
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes: shorter than the header length")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > len(data) - 8:
        raise ValueError(f"header length {header_len} past the end ({len(data)} bytes)")
    header = json.loads(data[8:8 + header_len])
    if header.get("format") != _FORMAT_1:
        raise ValueError(f"format {header.get('format')!r}, expected {_FORMAT_1!r}")
    tensors, offset = {}, 8 + header_len
    for name, dtype, shape, nbytes in header["tensors"]:
        if offset + int(nbytes) > len(data):
            raise ValueError(f"tensor {name!r}: {nbytes} bytes, {len(data) - offset} left")
        tensors[name] = _tensor(dtype, shape, data[offset:offset + nbytes])
        offset += nbytes
    if offset != len(data):
        raise ValueError(f"{len(data) - offset} bytes after the last tensor")
    return tensors, header["spec"]
