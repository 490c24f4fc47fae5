"""A process group that outlives generations: one object, its backend moved to each new one.

DDP, FSDP2, DTensor and ``DeviceMesh`` keep the group object they were built with. A
:class:`SurvivingGroup` is a Python subclass of ``torch.distributed.ProcessGroup`` (torch's
``PyProcessGroup`` trampoline lets C++ callers such as DDP's reducer reach the Python
overrides) whose collectives go to the gloo group of the current generation. The
:class:`~unbroken.parallel.fabric.Fabric` that owns it calls :meth:`SurvivingGroup._attach`
with the next generation's backend; the object DDP holds does not change.

Every collective is abortable (FACTS.md: nothing cancels a gloo op): the backend's work is
wrapped in an :class:`AbortableWork` whose ``wait()`` blocks in the backend's timed wait and
asks the abort signal between slices, and whose future is failed at once when the signal fires. The backend work it gave up on goes to
the fabric's graveyard (kept referenced until it ends, never destroyed early). Point-to-point
ops (a pipeline's sends and recvs) are abortable too: gloo's complete only inside ``wait()``,
so a :class:`ThreadWaitedWork` waits for them in a daemon thread and the timed wait asks it.

Before a rank's first generation the group is *detached*: collectives complete at once,
locally, as if every peer held what this rank holds (broadcast keeps the tensors, all-gather
fills every slot with this rank's input). That lets a replacement process build its DDP
(whose constructor verifies shapes and broadcasts the module) before it joins the survivors,
who are busy with the recovery and would not match those collectives. Reductions are refused
while detached: their result would be wrong.

Objects here are used in the training thread of one rank; a future may be completed from a
gloo worker thread or the thread that fires the abort signal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sys

import torch
import torch.distributed as dist

from unbroken.errors import UnbrokenError
from unbroken.parallel.ddp import DdpRegistry, constructing_ddp
from unbroken.parallel.work import AbortableWork, AbortSignal, DetachedCollective, ThreadWaitedWork, lost_peer_error

#: In the text of a gloo error raised by its transport (a pair to a peer broke), not by a check.
_TRANSPORT_ERROR = "gloo/transport/"

__all__ = ["AbortSignal", "AbortableWork", "DetachedCollective", "SurvivingGroup", "ThreadWaitedWork"]


def _first_tensors(args: tuple) -> list[torch.Tensor]:
    first = args[0]
    return first if isinstance(first, list) else [first]


class SurvivingGroup(dist.ProcessGroup):
    """A group of fixed ranks whose backend is the current generation's gloo group.

    Owned by one :class:`~unbroken.parallel.fabric.Fabric` (which builds it, attaches each
    generation's backend and holds the abort signal). ``global_ranks`` are the job ranks of
    its members, in group-rank order. ``before_reduce`` is called before each reduction is
    issued (the session marks its step's phase ``sync`` there), ``on_collective`` with the work of
    each other collective once issued (the session tells the hang rule it may wait there).

    *Held* (:attr:`held`, set by the fabric): attached to a generation, but collectives
    complete locally as when detached. A replacement holds its groups while the script builds
    its wrappers (whose constructors issue collectives the busy survivors would not match),
    and releases them when it takes part in the state transfer.
    """

    def __init__(self, rank: int, size: int, global_ranks: list[int], key: str,
                 signal: AbortSignal, graveyard: list[Any],
                 before_reduce: Callable[[], None] | None = None, ddps: DdpRegistry | None = None,
                 on_collective: Callable[[Any], None] | None = None) -> None:
        super().__init__(rank, size)
        self._ddps = ddps  # the fabric's record of the DDPs built on its groups (parallel/ddp.py)
        self.global_ranks = list(global_ranks)
        self.key = key  # names its store prefix in each generation: gen<g>/<key>/
        self._signal, self._graveyard = signal, graveyard
        self._before_reduce = before_reduce
        self._on_collective = on_collective  # given each other collective's work once issued (hang evidence)
        self._backend: Any = None  # a ProcessGroupGloo (torch Backend) or None
        self.on_op: Callable[[SurvivingGroup, str], None] | None = None  # told each op issued to a backend
        self._gen = -1  # -1: detached, no generation joined yet
        self.held = False
        self._group_name = ""

    # --- generations (called by the fabric) ---
    def _attach(self, gen: int, backend: Any) -> None:
        old, self._backend, self._gen = self._backend, backend, gen
        if old is not None:
            self._graveyard.append(old)  # its pending ops end at its timeout, not before

    @property
    def generation(self) -> int:
        return self._gen

    @property
    def backend(self) -> Any:
        return self._backend

    # --- what torch asks of a ProcessGroup ---
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "unbroken"

    def name(self) -> str:
        return "unbroken"

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def __repr__(self) -> str:
        return f"SurvivingGroup(key={self.key!r}, rank={self.rank()}, size={self.size()}, gen={self._gen})"

    def _issue(self, op: str, args: tuple, local: Callable[[], Any] | None,
               finish: Callable[[], Any] | None = None) -> AbortableWork:
        what = f"{op} on group {self.key!r} generation {self._gen}"
        if self._backend is None or self.held:
            if local is None:
                state = "while it is held (a replacement building its wrappers)" if self.held else \
                    "before this rank joined a generation"
                raise DetachedCollective(
                    f"{op} on group {self.key!r} {state}: only broadcast, all-gather and barrier "
                    "complete locally then (a reduction would be wrong); issue reductions in the "
                    "training loop, after unbroken has joined this rank to the survivors")
            return AbortableWork(None, self._signal, self._graveyard, what, result=local())
        if local is None and self._before_reduce is not None:
            self._before_reduce()
        if self.on_op is not None:
            self.on_op(self, op)
        inner = self._issued(what, lambda: getattr(self._backend, op)(*args))
        work = AbortableWork(inner, self._signal, self._graveyard, what, finish=finish)
        if local is not None and self._on_collective is not None:
            self._on_collective(work)
        return work

    def allreduce(self, *args):
        return self._issue("allreduce", args, None)

    def allreduce_coalesced(self, *args):
        return self._issue("allreduce_coalesced", args, None)

    def reduce(self, *args):
        return self._issue("reduce", args, None)

    def reduce_scatter(self, outputs, inputs, opts, *rest):
        flat = torch.cat([t.reshape(-1) for t in inputs[0]])
        return self._reduce_scatter_by_allreduce(outputs[0], flat, opts, outputs)

    def _reduce_scatter_base(self, output, input, opts, *rest):  # noqa: A002 - torch's name
        return self._reduce_scatter_by_allreduce(output, input.reshape(-1), opts, [output])

    def _reduce_scatter_by_allreduce(self, output: torch.Tensor, flat: torch.Tensor, opts: Any,
                                     result: list[torch.Tensor], then: Callable[[], None] | None = None
                                     ) -> AbortableWork:
        """Reduce-scatter as an all-reduce of a copy, then this rank's chunk into ``output``.

        Why: gloo's reduce-scatter works (torch 2.13, list and tensor forms) fill the output but
        never report ``is_completed()``, not even after ``wait()``, and have no future, so an
        abortable (polling) wait on them never ends: FSDP2's backward hung there. Twice the
        traffic of a real reduce-scatter; the same sums on every run.
        """
        if self.on_op is not None and self._backend is not None and not self.held:
            self.on_op(self, "reduce_scatter")  # (an all-reduce here, but each rank keeps its own chunk)
        buf = flat.clone()
        ar_opts = dist.AllreduceOptions()
        ar_opts.reduceOp = opts.reduceOp
        ar_opts.timeout = opts.timeout

        def finish() -> list[torch.Tensor]:
            output.copy_(buf.view(self.size(), -1)[self.rank()].view_as(output))
            if then is not None:
                then()
            return result
        return self._issue("allreduce", ([buf], ar_opts), None, finish=finish)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts, *rest):
        """gloo has no coalesced form: one reduce-scatter of the inputs laid side by side per rank chunk."""
        if len(inputs) == 1:
            return self._reduce_scatter_by_allreduce(outputs[0], inputs[0].reshape(-1), opts, outputs)
        size = self.size()
        flat = torch.cat([t.reshape(size, -1) for t in inputs], dim=1).reshape(-1)  # rank r's chunks together
        out = torch.empty(flat.numel() // size, dtype=flat.dtype, device=flat.device)

        def spread() -> None:
            offset = 0
            for output in outputs:
                output.copy_(out[offset:offset + output.numel()].view_as(output))
                offset += output.numel()
        return self._reduce_scatter_by_allreduce(out, flat, opts, outputs, then=spread)

    def broadcast(self, *args):
        return self._issue("broadcast", args, lambda: _first_tensors(args))

    def barrier(self, *args):
        return self._issue("barrier", args, lambda: [])

    def allgather(self, outputs, inputs, *rest):
        if self._ddps is not None and (ddp := constructing_ddp(sys._getframe(1))) is not None:
            self._ddps.note(ddp)  # a DDP's constructor verifies its parameters with this all-gather
        def local():
            for slots, tensor in zip(outputs, inputs):
                for slot in slots:
                    slot.copy_(tensor)
            return outputs
        return self._issue("allgather", (outputs, inputs, *rest), local)

    def _allgather_base(self, output, input, *rest):  # noqa: A002 - torch's name
        def local():
            output.view(-1, input.numel()).copy_(input.reshape(1, -1))
            return [output]
        return self._issue("_allgather_base", (output, input, *rest), local)

    def all_gather_single(self, output, input, *rest):  # noqa: A002 - 2.13's Python-side name
        return self._allgather_base(output, input, *rest)

    def reduce_scatter_single(self, *args):  # 2.13's Python-side name of _reduce_scatter_base
        return self._reduce_scatter_base(*args)

    def all_to_all_single(self, *args):  # 2.13's Python-side name of alltoall_base
        return self._issue("alltoall_base", args, None)

    def alltoall(self, *args):
        return self._issue("alltoall", args, None)

    def allgather_coalesced(self, *args):
        return self._issue("allgather_coalesced", args, None)

    def allgather_into_tensor_coalesced(self, outputs, inputs, *rest):
        """gloo has no coalesced form (the functional collectives, e.g. a DTensor's redistribute, call
        it): one all-gather of the inputs laid side by side, then each output filled from it."""
        def local():
            for output, tensor in zip(outputs, inputs):
                output.view(-1, tensor.numel()).copy_(tensor.reshape(1, -1))
            return outputs
        if self._backend is None or self.held:
            return self._issue("_allgather_base", (), local)
        if len({t.dtype for t in inputs}) > 1:
            raise UnbrokenError(f"allgather_into_tensor_coalesced on group {self.key!r}: inputs of dtypes "
                                f"{sorted(str(t.dtype) for t in inputs)}; one dtype per call is supported")
        flat = torch.cat([t.reshape(-1) for t in inputs])
        gathered = torch.empty(flat.numel() * self.size(), dtype=flat.dtype, device=flat.device)

        def finish() -> list[torch.Tensor]:
            rows, offset = gathered.view(self.size(), -1), 0
            for output, tensor in zip(outputs, inputs):
                output.view(self.size(), -1).copy_(rows[:, offset:offset + tensor.numel()])
                offset += tensor.numel()
            return outputs
        return self._issue("_allgather_base", (gathered, flat, *rest), local, finish=finish)

    def gather(self, *args):
        return self._issue("gather", args, None)

    def scatter(self, *args):
        return self._issue("scatter", args, None)

    def alltoall_base(self, *args):
        return self._issue("alltoall_base", args, None)

    def send(self, tensors, dst, tag):
        return self._issue_p2p("send", tensors, dst, tag)

    def recv(self, tensors, src, tag):
        return self._issue_p2p("recv", tensors, src, tag)

    def _issue_p2p(self, op: str, tensors: list[torch.Tensor], peer: int, tag: int) -> AbortableWork:
        """A send or recv (a pipeline's activations and gradients): abortable like the collectives,
        not a reduction (it marks no phase), refused while detached or held (it has no local result)."""
        what = f"{op} with group rank {peer} (tag {tag}) on group {self.key!r} generation {self._gen}"
        if self._backend is None or self.held:
            raise DetachedCollective(
                f"{what}: this rank has not joined the survivors yet (a replacement building its wrappers); "
                "point-to-point ops have no local result: issue them in the training loop")
        if self.on_op is not None:
            self.on_op(self, op)
        inner = ThreadWaitedWork(self._issued(what, lambda: getattr(self._backend, op)(tensors, peer, tag)), tensors)
        return AbortableWork(inner, self._signal, self._graveyard, what)

    def _issued(self, what: str, issue: Callable[[], Any]) -> Any:
        """The backend's work for ``issue()``. gloo raises at the issue, not at the wait, when the pair
        to the peer already broke (a send to a rank killed a moment ago: "Connection reset by peer"):
        that is a lost peer as a failed wait is, so it fails this generation the same way
        (:func:`lost_peer_error`). Any other error at the issue (a script's bad tensor) stays the script's."""
        try:
            return issue()
        except RuntimeError as err:
            if _TRANSPORT_ERROR not in str(err):
                raise
            self._signal.failed = True
            raise lost_peer_error(self._signal, what, err)  # noqa: B904 - err itself, or the order caused by it
