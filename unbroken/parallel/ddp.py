"""Keeping a stock ``DistributedDataParallel`` consistent across a generation switch.

DDP built on a :class:`~unbroken.parallel.group.SurvivingGroup` keeps working when the
group moves to a new generation; two pieces of its reducer's state need care:

* **after an aborted step** (survivors): the reducer may be left mid-backward (hooks
  expected, finalize pending). :func:`reset_after_abort` uses the reducer's own reset
  (``Reducer._reset_state``, the call DDP's ``_update_process_group`` makes), which also
  makes every rank rebuild its buckets at the same iteration, together with the replacement;
* **the bucket layout** (replacement): after its first iteration DDP rebuilds its buckets in
  the order gradients became ready; a fresh DDP starts in parameter order. A flat bucket laid
  out differently on one rank would sum the wrong elements together, silently. So a survivor
  sends :func:`bucket_layout` with the state, and the replacement calls :func:`adopt_layout`,
  which builds its reducer with the survivors' layout. Each rank then rebuilds at the
  iteration after the redone step (rank 0's layout, the same as before: the order is
  deterministic), so no rank's collectives go out of step.

Under ``unbroken run`` the session instead keeps one layout for the whole job: parameter order,
forced when the script tracks its DDP (``worker/wrappers.py``, so that a job restart is
bit-exact too). After a regroup every rank calls :func:`realign_buckets`: the reducer's reset
(survivors may be mid-backward) followed by the same forced layout, at the same point of the
transfer on every rank; nobody rebuilds later, and no layout needs to travel.

Which DDPs: every DDP built on a SurvivingGroup, tracked or not. Its constructor's first collective
(the all-gather of ``_verify_params_across_processes``) reaches the group's ``allgather``, which asks
:func:`constructing_ddp` for the DDP on the stack and records it with the fabric (:class:`DdpRegistry`),
in construction order (the same on every rank). A script that tracks the module inside its DDP
(``job.track(model=net)`` after ``ddp = DDP(net)``) then gets the same treatment as one that tracks
the DDP: left alone, the replacement's fresh DDP would rebuild its buckets at its second iteration (a
broadcast of rank 0's bucket indices) while the survivors, rebuilt long ago, broadcast BatchNorm
buffers: a gloo "collective mismatch" abort at every step after the first, and wrong sums before it.

Private torch APIs used (torch 2.13): ``Reducer._reset_state``, ``DDP._has_rebuilt_buckets``,
``DDP._get_ddp_logging_data()['rebuilt_per_bucket_param_indices']``, the ``dist.Reducer``
constructor as DDP's ``_ddp_init_helper`` calls it, ``DDP._comm_hooks``,
``DDP._static_graph_delay_allreduce_enqueued``, ``dist._compute_bucket_assignment_by_size``.

Runs in the training thread of one rank.
"""

from __future__ import annotations

import weakref
from types import FrameType

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

Layout = list[list[int]]

_DDP_INIT = DistributedDataParallel.__init__.__code__
_STACK_DEPTH = 16  # DDP.__init__ -> _verify_param_shape_across_processes -> (C++) -> allgather: a few frames


def constructing_ddp(frame: FrameType | None) -> DistributedDataParallel | None:
    """The DDP whose ``__init__`` is running at ``frame`` or within a few frames above it, if any."""
    for _ in range(_STACK_DEPTH):
        if frame is None:
            return None
        if frame.f_code is _DDP_INIT:
            obj = frame.f_locals.get("self")
            return obj if isinstance(obj, DistributedDataParallel) else None
        frame = frame.f_back
    return None


class DdpRegistry:
    """The DDP modules built on one fabric's groups, in construction order; weakly held (a DDP the
    script drops is forgotten). Used in the training thread of one rank."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []

    def note(self, ddp: DistributedDataParallel) -> None:
        if all(ref() is not ddp for ref in self._refs):
            self._refs.append(weakref.ref(ddp))

    def live(self) -> list[DistributedDataParallel]:
        self._refs = [ref for ref in self._refs if ref() is not None]
        return [ddp for ref in self._refs if (ddp := ref()) is not None]


def reset_after_abort(ddp: DistributedDataParallel) -> None:
    """A survivor: forget the aborted step's reduction and rebuild buckets with the others."""
    ddp.reducer._reset_state()
    ddp._has_rebuilt_buckets = False


def realign_buckets(ddp: DistributedDataParallel) -> bool:
    """Every rank after a regroup: reset the reducer, lay the buckets out in parameter order.

    A collective on the DDP's group (the reducer broadcasts rank 0's bucket indices): every
    rank calls it at the same point. Returns True if the buckets were rebuilt (False where the
    reducer never rebuilds: ``find_unused_parameters`` without ``static_graph``, on every rank).
    A ``static_graph`` DDP first gets a new reducer on every rank (:func:`restart_static_graph`).
    """
    if ddp.static_graph:
        restart_static_graph(ddp)
    ddp.reducer._reset_state()
    ddp.reducer._push_all_rebuilt_params()
    rebuilt = bool(ddp.reducer._rebuild_buckets())
    ddp._has_rebuilt_buckets = True  # DDP's forward would otherwise try to rebuild again
    return rebuilt


def restart_static_graph(ddp: DistributedDataParallel) -> None:
    """A ``static_graph`` DDP: a new reducer, as DDP's constructor builds it, so the next iteration
    is its first again.

    Why: a static-graph reducer's first iteration reduces differently from the later ones (one
    extra all-reduce of the used-parameter map, then every bucket at the end of the backward,
    queued by DDP's ``_DDPSink``), and the reducer keeps what it learnt there. A replacement's
    fresh DDP would issue that extra all-reduce while its survivors reduce their first bucket
    (gloo: "Received data size doesn't match expected size"). Every rank starting over keeps the
    collectives matched; the sums are the same (same buckets, same order). No collective here.
    """
    parameters, expect_sparse = ddp._build_params_for_reducer()
    limits, limits_for_rebuilding = ddp._bucket_config.compute_bucket_size_limits(
        static_graph=True, find_unused_parameters=ddp.find_unused_parameters)
    indices, per_bucket_limits = dist._compute_bucket_assignment_by_size(parameters, limits, expect_sparse)
    _install_reducer(ddp, parameters, expect_sparse, list(reversed(indices)), list(reversed(per_bucket_limits)),
                     limits_for_rebuilding)
    ddp._static_graph_delay_allreduce_enqueued = False  # DDP's forward queues the first iteration's reduction


def bucket_layout(ddp: DistributedDataParallel) -> Layout | None:
    """The parameter indices of each bucket after DDP's rebuild; None before it (parameter order)."""
    data = ddp._get_ddp_logging_data()
    text = data.get("rebuilt_per_bucket_param_indices", "") if data.get("has_rebuilt_buckets") else ""
    if not text:
        return None
    return [[int(i) for i in bucket.split()] for bucket in text.split(",") if bucket.strip()]


def adopt_layout(ddp: DistributedDataParallel, layout: Layout | None) -> None:
    """A replacement: lay its buckets out as ``layout`` (a survivor's :func:`bucket_layout`).

    Replaces the reducer of a DDP that has not run a step yet; its comm hooks are registered
    again on the new one. ``None`` (the survivors have not rebuilt either) changes nothing.
    """
    if layout is None:
        return
    parameters, expect_sparse = ddp._build_params_for_reducer()
    _, limits_for_rebuilding = ddp._bucket_config.compute_bucket_size_limits(
        static_graph=ddp.static_graph, find_unused_parameters=ddp.find_unused_parameters)
    _install_reducer(ddp, parameters, expect_sparse, layout, [ddp.bucket_bytes_cap] * len(layout),
                     limits_for_rebuilding)
    ddp._has_rebuilt_buckets = False


def _install_reducer(ddp: DistributedDataParallel, parameters: list, expect_sparse: list, layout: Layout,
                     per_bucket_limits: list[int], limits_for_rebuilding: list[int]) -> None:
    """Replace ``ddp``'s reducer by a new one over ``layout`` (as DDP's ``_ddp_init_helper`` builds it)."""
    ddp.reducer._remove_autograd_hooks()
    ddp.reducer = dist.Reducer(
        parameters, layout, per_bucket_limits, ddp.process_group, expect_sparse,
        ddp.bucket_bytes_cap, ddp.find_unused_parameters, ddp.gradient_as_bucket_view,
        ddp._build_debug_param_to_name_mapping(parameters), ddp._bucket_config.first_bucket_bytes_cap,
        ddp.skip_all_reduce_unused_params, ddp._use_python_reducer, limits_for_rebuilding,
        ddp.batched_grad_copy)
    ddp.logger = dist.Logger(ddp.reducer)
    ddp.reducer.set_logger(ddp.logger)
    if ddp.static_graph:
        ddp.reducer._set_static_graph()
    for hook, state in ddp._comm_hooks:
        dist._register_comm_hook(ddp.reducer, state, hook)
