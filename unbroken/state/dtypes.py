"""The one table of torch dtypes by name, and the dtypes each format stores natively.

A dtype is written by its torch name without the ``torch.`` prefix (``"float32"``,
``"bfloat16"``): in the state tree's spec (a dtype stored as raw bytes), in a blob's tensor
headers, in the memory tier's index and in the state transfer's index between ranks. Reading a
name back goes through :func:`dtype_named`, which knows torch's aliases too (``"float"``,
``"half"``): the names torch itself accepts, and nothing else (a name is never evaluated).
Pure; any thread.
"""

from __future__ import annotations

import safetensors.torch
import torch

#: Every torch dtype by name, aliases included (``"float"`` and ``"float32"`` alike).
DTYPES: dict[str, torch.dtype] = {name: d for name, d in vars(torch).items() if isinstance(d, torch.dtype)}
#: The name each dtype is written with (its canonical torch name).
_NAMES: dict[torch.dtype, str] = {d: str(d).removeprefix("torch.") for d in DTYPES.values()}

#: The dtypes every format here handles as they are: safetensors stores them, the state transfer
#: between ranks moves them (any other dtype travels as the raw bytes of a uint8 view).
PLAIN_DTYPES: frozenset[torch.dtype] = frozenset({
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool})

#: dtype -> safetensors' name for it ("F32"): the dtypes the installed safetensors stores natively
#: (the state tree stores any other as raw bytes), PLAIN_DTYPES where it does not say.
SAFETENSORS_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in (getattr(safetensors.torch, "_TYPES", None) or {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool}).items()}


def dtype_name(dtype: torch.dtype) -> str:
    """How ``dtype`` is written: ``"float32"`` for ``torch.float32``."""
    return _NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def dtype_named(name: object) -> torch.dtype | None:
    """The torch dtype called ``name`` (its name or one of torch's aliases); None for anything else."""
    return DTYPES.get(name) if isinstance(name, str) else None
