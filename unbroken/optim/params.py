"""What the sharded optimizer is given: parameter groups, names for messages, checksums.

Pure helpers, no collectives; used once at construction (and for messages at each step).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from unbroken.errors import OptimizerError

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class ParamGroup:
    """One user parameter group: all its parameters (for indexing), the trainable ones, options."""

    params: list[torch.Tensor]
    trainable: list[torch.Tensor]
    options: dict[str, Any] = field(default_factory=dict)


def collect_groups(params: nn.Module | Iterable[Any]) -> tuple[nn.Module | None, list[ParamGroup]]:
    """The module (if one was given) and the parameter groups, validated like torch does."""
    module = params if isinstance(params, nn.Module) else None
    if module is not None:
        raw: list[Any] = [{"params": list(module.parameters())}]
    elif isinstance(params, torch.Tensor):
        raise OptimizerError("params must be a module, an iterable of parameters or of parameter-group dicts, "
                             f"not a single {type(params).__name__}")
    else:
        raw = list(params)
    if raw and all(isinstance(x, dict) for x in raw):
        groups = []
        for i, g in enumerate(raw):
            if "params" not in g:
                raise OptimizerError(f"parameter group {i} has no 'params' entry")
            ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
            groups.append(ParamGroup(ps, [], {k: v for k, v in g.items() if k != "params"}))
    elif all(isinstance(x, torch.Tensor) for x in raw):
        groups = [ParamGroup(raw, [])]
    else:
        raise OptimizerError("params mixes tensors and group dicts; pass one kind")
    seen: set[int] = set()
    for g in groups:
        for p in g.params:
            if not isinstance(p, torch.Tensor):
                raise OptimizerError(f"params must hold tensors, got a {type(p).__name__}")
            if not p.is_leaf:
                raise OptimizerError(f"a parameter of shape {tuple(p.shape)} is not a leaf tensor (it was "
                                     "computed from others); optimize the model's nn.Parameters")
            if id(p) in seen:
                raise OptimizerError("a parameter appears more than once in params")
            seen.add(id(p))
        g.trainable = [p for p in g.params if p.requires_grad]
    if not any(g.trainable for g in groups):
        raise OptimizerError("ShardedOptimizer got no trainable parameters (none with requires_grad=True)")
    return module, groups


def param_names(module: nn.Module | None, params: list[torch.Tensor]) -> dict[int, str]:
    """id(param) -> a readable name with its shape, for error messages."""
    names = {id(p): f"#{i} {tuple(p.shape)}" for i, p in enumerate(params)}
    if module is not None:
        names.update({id(p): f"{n} {tuple(p.shape)}" for n, p in module.named_parameters()})
    return names


def checksum(flat: torch.Tensor, chunk: int = 1 << 20) -> tuple[int, int]:
    """Two position-sensitive integer sums of the raw bits: equal iff bit-identical (in practice)."""
    bits = flat.view(_INT_OF_SIZE[flat.element_size()])
    plain = torch.zeros((), dtype=torch.int64, device=flat.device)
    weighted = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), chunk):
        part = bits[start:start + chunk].to(torch.int64)
        weights = torch.arange(start, start + part.numel(), dtype=torch.int64, device=flat.device) % 65521 + 1
        plain += part.sum()
        weighted += (part * weights).sum()
    return int(plain), int(weighted)
