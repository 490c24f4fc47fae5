"""The replicated ZeRO-1 optimizer: optimizer state sharded inside blocks, blocks replicated.

:class:`ShardedOptimizer` wraps any *elementwise* torch optimizer (AdamW, Adam, SGD with
momentum, RMSprop, Adagrad, ... -- not ones that look at whole tensors, such as LBFGS or a
layer-wise trust ratio). Layout (see :mod:`unbroken.recovery.replica_map`): the d data-parallel
ranks form N = ``num_replicas`` blocks of d/N ranks; rank r updates shard ``r % (d/N)`` of
the flat parameter space, and the N ranks with the same shard hold identical state.

One ``step()``, in the training thread of each rank::

    phase "sync"    gradients packed into flat buckets (25 MB by default) and all-reduced
                    over all d ranks, asynchronously, then divided by d (as DDP averages)
    phase "update"  the reduced gradient exists on every rank; the wrapped optimizer
                    updates this rank's shard of the parameters in place
                    the updated shards are broadcast inside the block (parameter gather)
    phase "done"    every rank holds the new parameters; ``step_count`` += 1

Every collective is issued with ``async_op=True`` and waited on by polling, with the
optional ``should_abort()`` checked in between; when it returns True the step raises
:class:`~unbroken.errors.CollectiveAborted` and the pending work objects move to
``abandoned_work``, which the caller keeps until the process-group timeout ends them.
After an abort in "sync" the gradients are undefined (recompute them); after an abort
in the gather the shard is already updated: call :meth:`finish_step` on a new group
(:meth:`set_process_group`) or restore the state.

Model parameters become views into one flat buffer (as in Megatron's distributed
optimizer), so the gather writes the model directly and nothing is copied back. After
``step()`` or :meth:`sync_grads`, ``p.grad`` holds the averaged gradient, as under DDP; clip
gradients *after* :meth:`sync_grads`, never before ``step()`` (they would be local).

Memory: 8 + 8*N/d bytes per parameter for fp32 AdamW (the seeds' 4 + 16*N/d structure); the
table and what :meth:`ShardedOptimizer.memory_report` measures are in :mod:`unbroken.optim.statedict`.

Bit-exactness: the gradient buckets do not depend on N, and every shard boundary falls on a
64-element boundary, so N = 1, 2, ..., d give bit-identical weights for any elementwise
optimizer run with the same dtype and foreach/fused flags (tests/optim checks AdamW, SGD).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from unbroken.errors import CollectiveAborted, OptimizerError
from unbroken.optim import repair, statedict
from unbroken.comm.wait import AbortCheck, wait_all
from unbroken.worker.api import PhaseCallback, RecoverableState, SessionHooks
from unbroken.optim.layout import FlatLayout
from unbroken.parallel.group import SurvivingGroup
from unbroken.optim.params import (as_list, check_identical_rows, check_param_set, checksum, collect_groups,
                                   pack_grad, param_names)
from unbroken.recovery.replica_map import ReplicaMap

class ShardedOptimizer(torch.optim.Optimizer, RecoverableState):
    """ZeRO-1 with ``num_replicas`` copies of every optimizer shard. See the module docstring.

    ``params`` is a module (recommended: then a parameter added after construction is
    detected at the next step), an iterable of parameters, or of parameter-group dicts.
    Owns the flat parameter and gradient buffers, the wrapped optimizer (over this rank's
    shard) and the block's process group. Used from one thread, the training loop's.

    ``param_groups`` are the wrapped optimizer's groups (one flat shard tensor each), so a
    torch LR scheduler can drive it. A trainable parameter without a gradient at ``step()``
    counts as a zero gradient (as in a DDP bucket); torch would skip it instead.
    ``step_count`` counts completed steps; ``on_phase(phase, step)`` receives "sync",
    "update", "done" with ``step`` = ``step_count`` at the start of the step.
    """

    def __init__(self, params: nn.Module | Iterable[Any], optimizer_class: type[torch.optim.Optimizer]
                 = torch.optim.AdamW, num_replicas: int = 2, process_group: dist.ProcessGroup | None = None,
                 bucket_bytes: int = 25 * 2**20, on_phase: PhaseCallback | None = None,
                 should_abort: AbortCheck | None = None, *, block_group: dist.ProcessGroup | None = None,
                 **optimizer_kwargs: Any) -> None:
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise OptimizerError(f"bucket_bytes must be an int >= 1, got {bucket_bytes!r}")
        self.on_phase = on_phase
        self.should_abort = should_abort
        self.defer_aborted_gather = False  # set by an unbroken session: see step()
        self._abandoned_work: list[dist.Work] = []  # the graveyard: see unbroken.comm.wait
        self.retired_groups: list[dist.ProcessGroup] = []  # replaced by set_process_group()
        self.step_count = 0
        self._grads_synced = False
        self._gather_pending = False  # the shard is updated but the gather did not finish
        self._constructed = False
        self._module, self._groups = collect_groups(params)
        self._all_params = [p for g in self._groups for p in g.params]
        self._params = [p for g in self._groups for p in g.trainable]
        self._names = param_names(self._module, self._all_params)
        self._build_group(process_group, num_replicas)
        self._build_flat(bucket_bytes)
        self._validated = False  # parameters checked identical across ranks (first step, collective)
        self._adopt_params()
        self._build_inner(optimizer_class, optimizer_kwargs)
        self._gather_group = self._build_block_group(block_group)
        self._constructed = True

    # -- construction ---------------------------------------------------------------------
    def _build_group(self, process_group: dist.ProcessGroup | None, num_replicas: int) -> None:
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        if isinstance(process_group, SurvivingGroup) and process_group is dist.group.WORLD \
                and process_group.backend is not None:
            # The job's default group under `unbroken run` (job.process_group): the optimizer runs on
            # its current generation's gloo group, as unbroken's own collectives do, and recover()
            # moves it to each new one. A sub-group (a mesh's dp) is kept: it moves by itself.
            process_group = process_group.backend
        self.process_group = process_group  # None: one process, no collectives
        self.rank = process_group.rank() if process_group is not None else 0
        self.world_size = process_group.size() if process_group is not None else 1
        self.replica_map = ReplicaMap(self.world_size, num_replicas)  # validates num_replicas
        self._num_replicas = num_replicas
        self.shard_index = self.replica_map.shard_of(self.rank)

    def _build_flat(self, bucket_bytes: int) -> None:
        dtypes = sorted({str(p.dtype) for p in self._params})
        devices = sorted({str(p.device) for p in self._params})
        if len(dtypes) > 1 or len(devices) > 1:
            raise OptimizerError(
                f"ShardedOptimizer needs all trainable parameters in one dtype on one device; got "
                f"dtypes {dtypes} and devices {devices}. Convert the model (model.to(dtype, device)) first")
        first = self._params[0]
        self.layout = FlatLayout([[p.numel() for p in g.trainable] for g in self._groups], self.world_size,
                                 self.num_replicas, bucket_numel=max(1, bucket_bytes // first.element_size()))
        self._offsets = [off for offs in self.layout.param_offsets for off in offs]
        self._flat_param = torch.zeros(self.layout.padded_numel, dtype=first.dtype, device=first.device)
        self._flat_grad = torch.zeros_like(self._flat_param)
        with torch.no_grad():
            for p, off in zip(self._params, self._offsets):
                self._flat_param[off:off + p.numel()].copy_(p.reshape(-1))
        self._param_views = [self._flat_param[o:o + p.numel()].view_as(p) for p, o in zip(self._params, self._offsets)]
        self._grad_views = [self._flat_grad[o:o + p.numel()].view_as(p) for p, o in zip(self._params, self._offsets)]

    def _check_identical_params(self) -> None:
        """Collective, at the first step: every rank must start from the same layout and
        bit-identical parameters. Not at construction: a replacement process builds its
        optimizer alone and receives its state from replicas (:meth:`recover`)."""
        if self.world_size == 1:
            return
        mine = torch.tensor([self.layout.numel, len(self._params), self._num_replicas, *checksum(self._flat_param)],
                            dtype=torch.int64, device=self._flat_param.device)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        work = dist.all_gather(everyone, mine, group=self.process_group, async_op=True)
        wait_all([work], self.should_abort, self.abandoned_work, "parameter check at construction")
        check_identical_rows([t.tolist() for t in everyone], self.layout.numel)

    def _adopt_params(self) -> None:
        # The model's parameters become views of the flat buffer: the gather then updates
        # the model in place, and a checkpoint of the model reads the same memory.
        for p, view in zip(self._params, self._param_views):
            p.data = view

    def _build_inner(self, optimizer_class: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> None:
        self._pieces: list[torch.Tensor] = []
        for a, b in self.layout.pieces(self.shard_index):
            piece = self._flat_param[a:b]
            piece.grad = self._flat_grad[a:b]  # permanent: the update reads the reduced gradient here
            self._pieces.append(piece)
        groups = [{**g.options, "params": [piece]} for g, piece in zip(self._groups, self._pieces)]
        self._inner = optimizer_class(groups, **kwargs)
        # torch.optim.Optimizer's own bookkeeping (hooks, LR-scheduler compatibility); the
        # groups and the state are then the wrapped optimizer's very objects.
        super().__init__([{"params": [piece]} for piece in self._pieces], {})
        self._link_inner()

    @property
    def wrapped(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer over this rank's shard (its groups and state are this one's)."""
        return self._inner

    def _link_inner(self) -> None:
        self.defaults = self._inner.defaults
        self.param_groups = self._inner.param_groups
        self.state = self._inner.state

    def _build_block_group(self, block_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        """The group the updated shards are broadcast in; None when there is nothing to gather.

        Shard s's owner is local rank s of the block group, and also rank s of the whole
        group (block 0), so the same broadcast code works on either.
        """
        num_shards = self.layout.num_shards
        block = self.replica_map.block_of(self.rank)
        if block_group is not None:
            if block_group.size() != num_shards or block_group.rank() != self.shard_index:
                raise OptimizerError(
                    f"block_group has size {block_group.size()} and this rank is its rank {block_group.rank()}; "
                    f"expected size {num_shards} (world {self.world_size} / num_replicas {self.num_replicas}) "
                    f"and rank {self.shard_index}: ranks {self.replica_map.block_ranks(block)}")
            return block_group
        if num_shards == 1:
            return None
        if num_shards == self.world_size:
            return self.process_group
        try:
            members = dist.get_process_group_ranks(self.process_group)
        except (KeyError, ValueError, RuntimeError):
            # Not a group torch.distributed knows (built directly on a store): broadcast over
            # the whole group. Correct, but every rank receives every shard; pass block_group.
            return self.process_group
        ranks = self.replica_map.block_ranks(block)
        return dist.new_group([members[r] for r in ranks], use_local_synchronization=True)

    def set_process_group(self, process_group: dist.ProcessGroup,
                          block_group: dist.ProcessGroup | None = None) -> None:
        """Use a new process group (e.g. the next generation after a recovery): same size, same rank."""
        if process_group.size() != self.world_size or process_group.rank() != self.rank:
            raise OptimizerError(
                f"the new process group has rank {process_group.rank()} of {process_group.size()}; this "
                f"optimizer's layout is rank {self.rank} of {self.world_size}. Changing the world size "
                "needs a new ShardedOptimizer loaded with load_full_state_dict()")
        # The old groups may have abandoned work pending: keep them referenced (FACTS.md:
        # dropping the last reference to such a group blocks until its timeout).
        self.retired_groups += [g for g in (self.process_group, self._gather_group)
                                if g is not None and g not in self.retired_groups]
        self.process_group = process_group
        self._gather_group = self._build_block_group(block_group)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._constructed:
            raise OptimizerError("ShardedOptimizer cannot add parameter groups after construction (the flat "
                                 "layout is fixed); build a new one with all groups")
        super().add_param_group(param_group)

    # -- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Sync gradients, update this rank's shard, gather the parameters. See the module docstring."""
        if self._gather_pending:
            raise OptimizerError(
                f"step {self.step_count} was updated but its parameter gather did not finish (aborted); call "
                "finish_step() (after set_process_group() with a working group) or restore the state first")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step = self.step_count
        self.sync_grads()  # reports "sync" unless sync_grads() already ran for this step
        self._report("update", step)
        self._inner.step()
        self._gather_pending = True
        try:
            self._gather_flat(self._flat_param, f"parameter gather of step {step}")
        except (CollectiveAborted, RuntimeError):
            if not self.defer_aborted_gather:
                raise
            # The step is committed and this shard updated: an in-flight recovery completes
            # the gather (see unbroken.optim.repair); the training loop goes on meanwhile.
            return loss
        self._finish(step)
        return loss

    def release_process_groups(self) -> None:
        """Drop this optimizer's references to its process groups (the job is over)."""
        self.process_group = self._gather_group = None
        self.retired_groups = []

    @torch.no_grad()
    def recover(self, replaced: Iterable[int]) -> None:
        """Collective on the current (new) group after ranks were lost: see :mod:`unbroken.optim.repair`."""
        replaced = set(replaced)
        sources = repair.shard_sources(self, replaced)
        cut = self._gather_pending
        if cut:  # committed and updated here; the gather below completes it
            self._gather_pending = False
            self.step_count += 1
        step_count, any_cut = repair.agree(self, cut)
        repair.send_shards(self, sources, replaced)
        repair.gather_params(self, sources, replaced, everyone=any_cut)
        self.step_count = step_count
        self.zero_grad(set_to_none=True)
        self._validated = True  # the parameters are the holders' own: no first-step check

    def attach(self, hooks: SessionHooks) -> None:
        """An unbroken session's hooks (see :class:`unbroken.worker.api.RecoverableState`)."""
        if self.on_phase is None:
            self.on_phase = hooks.on_phase
        if self.should_abort is None:
            self.should_abort = hooks.should_abort
        self.defer_aborted_gather = self.defer_aborted_gather or hooks.defer_completion

    @property
    def num_replicas(self) -> int:
        """Copies of every optimizer shard (ranks holding it): see :mod:`unbroken.recovery.replica_map`."""
        return self._num_replicas

    @property
    def abandoned_work(self) -> list[dist.Work]:
        """Collective work left pending on an abort (the graveyard: see :mod:`unbroken.comm.wait`)."""
        return self._abandoned_work

    @property
    def flat_param(self) -> torch.Tensor:
        """The flat buffer every trainable parameter is a view of (the layout's order)."""
        return self._flat_param

    @property
    def step_pending(self) -> bool:
        """True when the last step's parameter gather was cut by a fault (the step itself committed)."""
        return self._gather_pending

    def finish_step(self) -> None:
        """Complete a step whose parameter gather was aborted (its shard update is already applied)."""
        if not self._gather_pending:
            return
        with torch.no_grad():
            self._gather_flat(self._flat_param, f"parameter gather of step {self.step_count}")
        self._finish(self.step_count)

    def _finish(self, step: int) -> None:
        self._gather_pending = False
        self._grads_synced = False
        self.step_count += 1
        self._report("done", step)

    def _report(self, phase: str, step: int) -> None:
        if self.on_phase is not None:
            self.on_phase(phase, step)

    @torch.no_grad()
    def sync_grads(self) -> None:
        """All-reduce and average the gradients now (``step()`` does it if not done yet).

        Afterwards ``p.grad`` of every trainable parameter is a view of the averaged flat
        gradient, so in-place changes (``clip_grad_norm_``) are what the update uses.
        """
        if self._grads_synced:
            return
        check_param_set(self._module, self._params, self._names, self._param_views)  # changed since built?
        if not self._validated:  # once, at the first step: every rank calls step() together
            self._check_identical_params()
            self._validated = True
        self._report("sync", self.step_count)
        buckets = self.layout.grad_buckets()
        works, next_bucket = [], 0
        for i, (p, view) in enumerate(zip(self._params, self._grad_views)):
            pack_grad(p, view, self._names)
            # Buckets wholly below the next parameter's offset are complete: send them now.
            ready = self._offsets[i + 1] if i + 1 < len(self._params) else self.layout.used_numel
            while self.world_size > 1 and next_bucket < len(buckets) and buckets[next_bucket][1] <= ready:
                a, b = buckets[next_bucket]
                works.append(dist.all_reduce(self._flat_grad[a:b], group=self.process_group, async_op=True))
                next_bucket += 1
        wait_all(works, self.should_abort, self.abandoned_work, f"gradient all-reduce of step {self.step_count}")
        if self.world_size > 1:
            self._flat_grad[:self.layout.used_numel].div_(self.world_size)  # sum / d, as DDP averages
        for p, view in zip(self._params, self._grad_views):
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view
        self._grads_synced = True

    def _gather_flat(self, flat: torch.Tensor, what: str) -> None:
        """Fill every shard's range of ``flat`` from its owner; this rank's range must be valid."""
        group = self._gather_group
        if group is None:
            return
        works = []
        for shard in range(self.layout.num_shards):
            for a, b in self.layout.gather_chunks(shard):
                works.append(dist.broadcast(flat[a:b], group=group, group_src=shard, async_op=True))
        wait_all(works, self.should_abort, self.abandoned_work, what)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Like torch: ``set_to_none`` drops the gradients; otherwise they are zeroed in place,
        and gradients that are views of the flat buffer then accumulate there without a copy."""
        self._grads_synced = False
        if not set_to_none:
            self._flat_grad.zero_()
        for p, view in zip(self._params, self._grad_views):
            if set_to_none:
                p.grad = None
            elif p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                p.grad.detach_().zero_()

    # -- state -------------------------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        start, end = self.layout.shard_range(self.shard_index)
        return {**self.layout.fingerprint(), "shard_index": self.shard_index, "shard_range": [start, end],
                "step_count": self.step_count, "optimizer_class": type(self._inner).__qualname__}

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: the wrapped optimizer's state dict (tensors are the live state,
        as with torch) plus ``"sharding"`` metadata: layout, shard index and range, step count."""
        sd = self._inner.state_dict()
        sd["sharding"] = self._meta()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` saved by the same rank of the same layout (tensors are copied)."""
        meta = state_dict.get("sharding")
        if not isinstance(meta, dict):
            raise OptimizerError("this is not a ShardedOptimizer shard state dict (no 'sharding' entry); "
                                 "a plain torch optimizer state dict loads with load_full_state_dict()")
        mine = self._meta()
        wrong = {k: (meta.get(k), v) for k, v in mine.items()
                 if k not in ("step_count", "optimizer_class") and as_list(meta.get(k)) != as_list(v)}
        if wrong:
            detail = ", ".join(f"{k}: saved {s!r}, here {h!r}" for k, (s, h) in wrong.items())
            raise OptimizerError(f"shard state dict does not fit this rank's layout ({detail}); to change the "
                                 "layout or world size use full_state_dict() and load_full_state_dict()")
        inner = {"state": statedict.clone_tree(state_dict["state"]), "param_groups": state_dict["param_groups"]}
        self._load_inner(inner, int(meta["step_count"]))

    def _load_inner(self, inner_sd: dict[str, Any], step_count: int) -> None:
        self._validated = True  # restored state: the parameters come with it, no first-step check
        self._inner.load_state_dict(inner_sd)
        self._link_inner()  # torch replaced the group dicts
        self.step_count = step_count
        self._grads_synced = False
        self._gather_pending = False

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, Any]:
        """Collective (every rank calls it; every rank gets the result): the consolidated state,
        keyed like a plain torch optimizer over the same parameters (``model.parameters()``),
        plus ``"unbroken"``: step count and the layout it came from."""
        pieces = self.layout.pieces(self.shard_index)
        states = [self._inner.state.get(piece, {}) for piece in self._pieces]
        keys = sorted({k for st in states for k, v in st.items() if statedict.is_flat_state(v)})
        flats = {}
        for key in keys:
            sample = next(st[key] for st in states if key in st)
            flat = torch.zeros(self.layout.padded_numel, dtype=sample.dtype, device=sample.device)
            for st, (a, b) in zip(states, pieces):
                if key in st:
                    flat[a:b].copy_(st[key])
            self._gather_flat(flat, f"optimizer state gather ({key})")
            flats[key] = flat
        full = statedict.split_full(self._groups, self._all_params, self.layout, states, flats,
                                    [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups])
        full["unbroken"] = {"step_count": self.step_count, "world_size": self.world_size,
                            "num_replicas": self.num_replicas}
        return full

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated state (from :meth:`full_state_dict` or a plain torch optimizer
        over the same parameters) into this rank's shard, whatever layout saved it. Local."""
        inner_sd, step_count = statedict.shard_from_full(
            state_dict, self._groups, self.layout, self.shard_index, self._flat_param.device)
        self._load_inner(inner_sd, step_count)

    def memory_report(self) -> dict[str, Any]:
        """Optimizer memory on this rank, measured, next to the formula (module docstring)."""
        return statedict.memory_report(self.layout, [self._inner.state.get(p, {}) for p in self._pieces],
                                       shard_index=self.shard_index,
                                       param_element_bytes=self._flat_param.element_size())
