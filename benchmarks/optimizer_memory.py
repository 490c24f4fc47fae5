"""Optimizer memory per parameter on TP x PP x DP layouts, measured from live optimizers (optimizer.py).

The seeds' table (MindIO TFT, bf16 with the distributed optimizer): ``4 + 16*N/d`` bytes per
parameter, d the data-parallel size and N the replicas of each optimizer shard: 4 = the bf16
parameter and gradient every rank holds, 16 = the fp32 master copy, fp32 gradient and Adam's two
moments, sharded over the d/N ranks of a block. Ours is fp32 with no master copy: ``8 + 8*N/d``:
8 = the fp32 parameter and gradient every rank holds, 8*N/d = AdamW's ``exp_avg`` and
``exp_avg_sq`` (4 bytes each), sharded over d/N ranks (N = d: every dp rank holds all of it, the
seeds' native fp32 16). Tensor and pipeline parallelism cut what a rank holds (its tp shard of its
stage) and leave the per-parameter figure alone: "per parameter" here is per parameter *this rank
holds*, and the ``of model`` column says which share of the whole model that is.

:func:`measure` runs inside optimizer.py's worker processes (plain gloo, every rank calls it at the
same point: the meshes' groups are collectives), one layout after another: it builds the layout's
mesh with ``init_device_mesh``, this rank's stage of the model (tp-sharded with DTensor when tp > 1),
a live optimizer over it (unbroken's ShardedOptimizer on the dp group, or torch AdamW for N = d),
one step on zero gradients so the state exists, then counts the bytes of its state. A ShardedOptimizer
takes plain tensors only: on a tp layout it is given this rank's local shards as parameters (the same
sizes the DTensors hold locally). Every rank's (state bytes, local parameters) is all-gathered as a
tensor (nothing is pickled); the table shows the largest rank's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# (pp, dp, tp, N): N = None means torch AdamW on every dp rank (N = d).
LAYOUTS = ((1, 4, 1, 1), (1, 4, 1, 2), (1, 4, 1, None), (2, 2, 1, 1), (2, 2, 1, None),
           (1, 2, 2, 1), (1, 2, 2, None), (2, 1, 2, None))
HYPER = {"lr": 3e-4, "weight_decay": 0.1, "betas": (0.9, 0.95)}
PARAM_BYTES = 4  # fp32
STATE_BYTES = 8  # AdamW: exp_avg + exp_avg_sq, fp32


def formula(dp: int, replicas: int) -> tuple[float, float]:
    """(optimizer state, total incl. parameter and gradient) bytes per parameter a rank holds."""
    state = STATE_BYTES * replicas / dp
    return state, 2 * PARAM_BYTES + state


def _stage(model: nn.Module, pp_index: int, pp: int) -> list[nn.Module]:
    """The modules of pipeline stage ``pp_index``: its blocks, plus the embeddings (first) / head (last)."""
    blocks = list(model.blocks)
    per = len(blocks) // pp
    parts: list[nn.Module] = blocks[pp_index * per:(pp_index + 1) * per]
    if pp_index == 0:
        parts += [model.wte, model.wpe]
    if pp_index == pp - 1:
        parts += [model.ln_f, model.head]
    return parts


def _tp_shard(parts: list[nn.Module], tp_mesh: Any) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"qkv": ColwiseParallel, "proj": RowwiseParallel, "mlp.0": ColwiseParallel, "mlp.2": RowwiseParallel}
    for block in parts:
        if hasattr(block, "qkv"):  # a transformer block; embeddings, norms and head stay replicated
            parallelize_module(block, tp_mesh, {k: v() for k, v in plan.items()}, src_data_rank=None)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(_local(v).nbytes for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() >= 1)


def _one_layout(build_model, pp: int, dp: int, tp: int, replicas: int | None) -> tuple[int, int]:
    """(optimizer state bytes, parameters held) on this rank for one layout."""
    from torch.distributed.device_mesh import init_device_mesh

    from unbroken.optim import ShardedOptimizer

    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    coords = mesh.get_coordinate()
    parts = _stage(build_model(), coords[0], pp)
    if tp > 1:
        _tp_shard(parts, mesh["tp"])
    params = [p for m in parts for p in m.parameters()]
    if replicas is None:
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, foreach=False, **HYPER)
    else:  # ShardedOptimizer on the dp group; a block of d/N ranks shares each shard's update
        params = [nn.Parameter(_local(p).detach().clone()) for p in params]
        group = mesh.get_group("dp")
        block = group if dp // replicas == dp else None
        opt = ShardedOptimizer(params, torch.optim.AdamW, num_replicas=replicas, process_group=group,
                               block_group=block, **HYPER)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    return _state_bytes(opt), sum(_local(p).numel() for p in params)


def measure(build_model, world_size: int) -> list[dict[str, Any]]:
    """Every layout's row (the same on every rank); a collective of all ranks."""
    rows = []
    for pp, dp, tp, replicas in LAYOUTS:
        if pp * dp * tp != world_size:
            continue
        state, held = _one_layout(build_model, pp, dp, tp, replicas)
        everyone = [torch.zeros(2, dtype=torch.int64) for _ in range(world_size)]
        dist.all_gather(everyone, torch.tensor([state, held], dtype=torch.int64))
        state, held = max((int(t[0]), int(t[1])) for t in everyone)  # the rank holding the most state
        n = dp if replicas is None else replicas
        rows.append({"pp": pp, "dp": dp, "tp": tp, "num_replicas": n,
                     "optimizer": "torch AdamW" if replicas is None else "ShardedOptimizer",
                     "params_held": held, "state_bytes": state, "state_bytes_per_param": state / held,
                     "formula_state_bytes_per_param": formula(dp, n)[0],
                     "bytes_per_param": 2 * PARAM_BYTES + state / held, "formula_bytes_per_param": formula(dp, n)[1]})
    return rows


def print_rows(rows: list[dict[str, Any]], model_params: int) -> None:
    print("optimizer memory per parameter a rank holds (fp32 AdamW; largest rank; formula 8 + 8*N/d: "
          "8 = fp32 param + grad on every rank, 8*N/d = exp_avg + exp_avg_sq sharded over d/N ranks; "
          "the seeds' bf16: 4 + 16*N/d)")
    print(f"{'pp':>3} {'dp':>3} {'tp':>3} {'N':>3} {'optimizer':<17} {'params held':>12} {'of model':>9} "
          f"{'state B/param':>14} {'formula':>8} {'total B/param':>14} {'formula':>8}")
    for r in rows:
        print(f"{r['pp']:>3} {r['dp']:>3} {r['tp']:>3} {r['num_replicas']:>3} {r['optimizer']:<17} "
              f"{r['params_held']:>12} {r['params_held'] / model_params:>9.2f} {r['state_bytes_per_param']:>14.3f} "
              f"{r['formula_state_bytes_per_param']:>8.3f} {r['bytes_per_param']:>14.3f} "
              f"{r['formula_bytes_per_param']:>8.3f}")
