"""The one dtype table: every torch dtype by its name and back, torch's aliases read, nothing else."""

from __future__ import annotations

import pytest
import torch

from unbroken.state import dtypes
from unbroken.state.dtypes import PLAIN_DTYPES, SAFETENSORS_NAMES, dtype_name, dtype_named


@pytest.mark.parametrize("dtype", sorted(set(dtypes.DTYPES.values()), key=str))
def test_every_dtype_round_trips_by_its_name(dtype):
    assert dtype_name(dtype) == str(dtype).removeprefix("torch.")
    assert dtype_named(dtype_name(dtype)) is dtype


def test_torch_aliases_are_read_and_anything_else_is_none():
    assert dtype_named("float") is torch.float32 and dtype_named("half") is torch.float16
    assert dtype_named("long") is torch.int64
    for name in ("torch.float32", "Tensor", "nn", "", None, 3, b"float32"):
        assert dtype_named(name) is None, name


def test_safetensors_stores_at_least_the_plain_dtypes_and_names_them():
    assert PLAIN_DTYPES <= set(SAFETENSORS_NAMES)
    assert SAFETENSORS_NAMES[torch.float32] == "F32" and SAFETENSORS_NAMES[torch.bfloat16] == "BF16"
    assert torch.complex128 not in SAFETENSORS_NAMES  # stored as raw bytes by the state tree
