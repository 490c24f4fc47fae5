"""Training state laid out as DTensors (FSDP2, HSDP): each rank's local shards, and who else holds them.

A module wrapped by ``fully_shard`` holds its parameters as DTensors over a ``DeviceMesh``, and
a torch optimizer over them keeps its moments as DTensors too. Checkpoints and in-flight
transfers carry only what a rank holds: :func:`local_tree` replaces every DTensor of a state
tree by its local tensor (no gather, no copy: a view of the shard), and :func:`load_module` /
:func:`load_optimizer` put local tensors back (in place for a module; an optimizer's moments
are wrapped again as DTensors laid out like their parameter).

Who holds an identical copy (DESIGN.md section 12): rank r's local shard of a DTensor is
equal on every rank with r's mesh coordinate in each dimension the DTensor is *not* replicated
over (HSDP's shard dimension); :func:`shard_classes` gives each rank of the job such a class
for a whole object, and :func:`replica_layout_problem` says whether those classes are the
blocks unbroken's replica map assumes (rank r and r + world/N hold the same shard), which the
controller's feasibility check and the dump writers rely on.

Pure functions over torch objects; called in the training thread of one rank.
"""

from __future__ import annotations

import itertools
import sys
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch

from unbroken.errors import CheckpointError
from unbroken.recovery.replica_map import Piece, ReplicaMap


def _dtensor_class() -> type | None:
    """DTensor, if torch.distributed.tensor is imported (a script with DTensors has imported it;
    importing it here would slow every worker's start)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def has_dtensors(obj: Any) -> bool:
    """True if ``obj`` (a module or an optimizer) holds DTensor parameters."""
    dtensor = _dtensor_class()
    return dtensor is not None and any(isinstance(p, dtensor) for p in _params(obj))


def _params(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.nn.Module):
        return obj.parameters()
    if isinstance(obj, torch.optim.Optimizer):
        return (p for group in obj.param_groups for p in group["params"])
    return ()


def local_tree(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by its local shard (a view: nothing is copied)."""
    return _local(tree, _dtensor_class())


def _local(tree: Any, dtensor: type | None) -> Any:
    if dtensor is not None and isinstance(tree, dtensor):
        return tree._local_tensor.detach()
    if isinstance(tree, dict):
        items = ((k, _local(v, dtensor)) for k, v in tree.items())
        out = OrderedDict(items) if isinstance(tree, OrderedDict) else dict(items)
        if hasattr(tree, "_metadata"):
            out._metadata = tree._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(tree, list):
        return [_local(v, dtensor) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_local(v, dtensor) for v in tree)
    return tree


def load_module(module: torch.nn.Module, state: dict[str, Any]) -> None:
    """Copy a :func:`local_tree` of ``module.state_dict()`` into the module's own tensors, in place.

    CheckpointError naming the key when a key is missing or extra, or a shard's shape differs
    (the state was made for another mesh or model).
    """
    own = module.state_dict()  # FSDP2's pre-hook reshards first: these are the sharded parameters
    dtensor = _dtensor_class()
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        raise CheckpointError(f"sharded module state does not match the module: missing {missing}, unexpected {extra}")
    with torch.no_grad():
        for key, target in own.items():
            local = target._local_tensor if dtensor is not None and isinstance(target, dtensor) else target
            value = state[key]
            if not isinstance(value, torch.Tensor) or value.shape != local.shape:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise CheckpointError(f"sharded module state {key!r}: local shard of shape {got}, this rank "
                                      f"holds {tuple(local.shape)} (another mesh or model?)")
            local.copy_(value)


def load_optimizer(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a :func:`local_tree` of ``optimizer.state_dict()``: each per-parameter tensor shaped like
    its DTensor parameter's local shard becomes a DTensor laid out like that parameter."""
    from torch.distributed.tensor import DTensor

    optimizer.load_state_dict(state)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor) or p not in optimizer.state:
                continue
            entry = optimizer.state[p]
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and \
                        value.shape == p._local_tensor.shape and value.dim() > 0:
                    entry[key] = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False,
                                                    shape=p.shape, stride=p.stride())


def shard_classes(obj: Any, world_size: int) -> list[tuple] | None:
    """For each rank of the job, a class equal on exactly the ranks holding identical local state of
    ``obj``; None if ``obj`` holds no DTensor (replicated as a whole). A rank outside some mesh
    gets a class of its own (no replica)."""
    dtensor = _dtensor_class()
    layouts: dict[tuple, Any] = {}
    for p in _params(obj):
        if dtensor is not None and isinstance(p, dtensor):
            mesh = p.device_mesh
            layouts.setdefault((id(mesh), tuple(p.placements)), (mesh, p.placements))
    if not layouts:
        return None
    classes: list[list] = [[] for _ in range(world_size)]
    for n, (mesh, placements) in enumerate(layouts.values()):
        ranks = mesh.mesh
        sharded = [d for d, pl in enumerate(placements) if not pl.is_replicate()]
        seen = set()
        for index in itertools.product(*(range(size) for size in ranks.shape)):
            rank = int(ranks[index])
            seen.add(rank)
            classes[rank].append((n, tuple(index[d] for d in sharded)))
        for rank in set(range(world_size)) - seen:
            classes[rank].append((n, "outside", rank))
    return [tuple(c) for c in classes]


def holders_by_class(classes: list[tuple]) -> dict[tuple, list[int]]:
    """{class: the ranks in it, ascending}."""
    out: dict[tuple, list[int]] = {}
    for rank, cls in enumerate(classes):
        out.setdefault(cls, []).append(rank)
    return out


def num_replicas(classes: list[tuple]) -> int:
    """The fewest ranks holding any one class (1: some rank's shards have no replica)."""
    return min(len(ranks) for ranks in holders_by_class(classes).values())


def replica_layout_problem(classes: list[tuple]) -> str:
    """"" if the holders of every rank's shards are the replica map's blocks (rank r, r + world/N, ...)
    for N = :func:`num_replicas`; else what differs (the controller could not plan from it)."""
    world_size, replicas = len(classes), num_replicas(classes)
    if world_size % replicas:
        return f"{replicas} replicas do not divide the world of {world_size} ranks"
    expected, by_class = ReplicaMap(world_size, replicas), holders_by_class(classes)
    for rank, cls in enumerate(classes):
        holders = by_class[cls]
        want = expected.holders(Piece("optimizer_shard", expected.shard_of(rank)))
        if holders != want:
            return (f"rank {rank}'s shards are held by ranks {holders}, not {want}: put the mesh's "
                    "replicate dimension first, e.g. init_device_mesh(..., (replicas, shards))")
    return ""


def mesh_groups(obj: Any) -> list[Any]:
    """The process groups of every mesh dimension ``obj``'s DTensors live on (this rank's groups)."""
    dtensor = _dtensor_class()
    meshes = {id(p.device_mesh): p.device_mesh for p in _params(obj) if dtensor is not None and isinstance(p, dtensor)}
    return [mesh.get_group(dim) for mesh in meshes.values() for dim in range(mesh.ndim)]
