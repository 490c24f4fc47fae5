"""What the sharded optimizer is given: parameter groups, names for messages, checksums.

Pure helpers, no collectives: at construction, at each step (the parameter set check) and at the
first step (comparing the ranks' rows of the identical-parameters check).
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


@torch.no_grad()
def check_param_set(module: nn.Module | None, params: list[torch.Tensor], names: dict[int, str],
                    views: list[torch.Tensor]) -> None:
    """Refuse a trainable parameter set that changed since the optimizer was built (``params``,
    each a view of the flat buffer in ``views``); a parameter whose storage was replaced
    (``p.data = ...``) is copied back into its view and re-adopted."""
    if module is not None:
        current = [p for p in module.parameters() if p.requires_grad]
        if len(current) != len(params) or any(a is not b for a, b in zip(current, params)):
            known = {id(p) for p in params}
            now = {id(p) for p in current}
            current_names = param_names(module, current)
            added = [current_names[id(p)] for p in current if id(p) not in known]
            gone = [names[id(p)] for p in params if id(p) not in now]
            raise OptimizerError(
                f"the model's trainable parameters changed after the ShardedOptimizer was built: "
                f"{len(params)} then, {len(current)} now; new or replaced: {added}; gone or frozen: "
                f"{gone}. Build a new optimizer (load_full_state_dict carries the state over)")
    for p, view in zip(params, views):
        if not p.requires_grad:
            raise OptimizerError(f"parameter {names[id(p)]} was trainable at construction and now has "
                                 "requires_grad=False; build a new optimizer to change what is trained")
        if p.data_ptr() != view.data_ptr():
            if p.shape != view.shape or p.dtype != view.dtype or p.device != view.device:
                raise OptimizerError(
                    f"parameter {names[id(p)]} changed from {tuple(view.shape)} {view.dtype} on "
                    f"{view.device} to {tuple(p.shape)} {p.dtype} on {p.device}; build a new optimizer")
            view.copy_(p)  # its storage was replaced (p.data = ...): take the values back in
            p.data = view


def check_identical_rows(rows: list[list[int]], numel: int) -> None:
    """Every rank's row [trainable elements, trainable tensors, num_replicas, *checksum] of the
    first step's check must match rank 0's; OptimizerError naming what differs, and where."""
    for column, what in ((0, "trainable elements"), (1, "trainable parameter tensors"), (2, "num_replicas")):
        if len({row[column] for row in rows}) > 1:
            raise OptimizerError(f"ranks disagree on the number of {what}: "
                                 f"{ {r: row[column] for r, row in enumerate(rows)} }; build the same model "
                                 "and pass the same num_replicas on every rank")
    differ = [r for r, row in enumerate(rows) if row[3:] != rows[0][3:]]
    if differ:
        raise OptimizerError(
            f"parameters are not identical across ranks at the first step: ranks {differ} differ from "
            f"rank 0 (checksum of {numel} elements). Seed the model identically on every "
            "rank (torch.manual_seed before building it) or broadcast rank 0's parameters first")


def as_list(value: Any) -> Any:
    """A tuple as a list (layout metadata compares equal after a JSON round trip)."""
    return list(value) if isinstance(value, tuple) else value


def pack_grad(p: torch.Tensor, view: torch.Tensor, names: dict[int, str]) -> None:
    """Put ``p``'s gradient into its view of the flat gradient (none counts as zero)."""
    grad = p.grad
    if grad is None:
        view.zero_()  # no gradient this step counts as zero (as in a DDP bucket)
    elif grad.is_sparse:
        raise OptimizerError(f"parameter {names[id(p)]} has a sparse gradient; ShardedOptimizer needs dense ones")
    elif grad.data_ptr() != view.data_ptr():
        view.copy_(grad)
