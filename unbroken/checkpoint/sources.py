"""The tensors of a state tree, as the memory tier copies them: where each lands, where it comes from.

Used by :class:`unbroken.checkpoint.memory.SnapshotWriter` in the training thread; pure.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from unbroken.state.tree import flatten_state


def is_host(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def flatten_sources(state: Any) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict]:
    """flatten_state as {name: (host layout, source tensor)}, without staging copies.

    flatten_state would copy a device (or non-contiguous) tensor into fresh host memory: a
    copy plus page faults. Instead each such tensor stands in, while flattening, as an
    untouched host placeholder of its shape and dtype, and its bytes go straight from the
    device into the slot. The host layout (dtype, shape) is what flatten_state recorded.
    """
    stand_ins: dict[tuple, torch.Tensor] = {}  # view of a device storage -> placeholder
    origin: dict[int, torch.Tensor] = {}  # placeholder data_ptr -> device tensor

    def swap(x: Any) -> Any:
        kind = type(x)
        if kind in (dict, OrderedDict):
            out = kind((k, swap(v)) for k, v in x.items())
            if hasattr(x, "_metadata"):
                out._metadata = x._metadata
            return out
        if kind in (list, tuple):
            return kind(swap(v) for v in x)
        if kind in (torch.Tensor, torch.nn.Parameter) and x.numel() > 0 and not x.is_quantized \
                and x.layout == torch.strided and x.device.type != "meta" \
                and not (is_host(x) and x.is_contiguous()):
            key = (str(x.device), x.untyped_storage().data_ptr(), x.storage_offset(),
                   tuple(x.shape), x.stride(), x.dtype)
            if key not in stand_ins:  # tied weights share one placeholder: stored once
                stand_ins[key] = torch.empty(x.shape, dtype=x.dtype)
                origin[stand_ins[key].data_ptr()] = x.detach()
            return stand_ins[key]
        return x

    tensors, spec = flatten_state(swap(state))
    return {name: (t, origin.get(t.data_ptr(), t) if t.numel() else t)
            for name, t in tensors.items()}, spec
