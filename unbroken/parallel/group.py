"""A process group that outlives generations: one object, its backend moved to each new one.

DDP, FSDP2, DTensor and ``DeviceMesh`` keep the group object they were built with. A
:class:`SurvivingGroup` is a Python subclass of ``torch.distributed.ProcessGroup`` (torch's
``PyProcessGroup`` trampoline lets C++ callers such as DDP's reducer reach the Python
overrides) whose collectives go to the gloo group of the current generation. The
:class:`~unbroken.parallel.fabric.Fabric` that owns it calls :meth:`SurvivingGroup._attach`
with the next generation's backend; the object DDP holds does not change.

Every collective is abortable (FACTS.md: nothing cancels a gloo op): the backend's work is
wrapped in an :class:`AbortableWork` whose ``wait()`` polls and asks the abort signal, and
whose future is failed at once when the signal fires. The backend work it gave up on goes to
the fabric's graveyard (kept referenced until it ends, never destroyed early). Point-to-point
ops (a pipeline's sends and recvs) are abortable too: gloo's complete only inside ``wait()``,
so a :class:`ThreadWaitedWork` waits for them in a daemon thread and the polling asks it.

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

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from unbroken.comm import wait_all
from unbroken.errors import CollectiveAborted, UnbrokenError


class DetachedCollective(UnbrokenError):
    """A reduction was issued on a :class:`SurvivingGroup` that has not joined a generation."""


class AbortSignal:
    """The abort order of one job as seen by one process: set once per generation.

    ``fire()`` may be called from any thread (a control-plane thread, a store watcher); it
    fails the future of every collective still pending. ``is_set()`` is what polling waits ask.
    ``clear()`` is called by the fabric when the next generation is attached.
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._pending: set[AbortableWork] = set()
        self.reason = ""
        self.failed = False  # a collective of this generation failed or was aborted (cleared by clear())

    def is_set(self) -> bool:
        return self._event.is_set()

    def fire(self, reason: str) -> None:
        with self._lock:
            self.reason = reason
            self._event.set()
            pending, self._pending = self._pending, set()
        for work in pending:
            work._fail(CollectiveAborted(f"collective aborted on the abort order ({reason})"))

    def clear(self) -> None:
        with self._lock:
            self._event.clear()
            self.reason = ""
            self.failed = False

    def _track(self, work: AbortableWork) -> bool:
        """Register ``work``; False when the signal is already set (the caller fails it)."""
        with self._lock:
            if self._event.is_set():
                return False
            self._pending.add(work)
            return True

    def _untrack(self, work: AbortableWork) -> None:
        with self._lock:
            self._pending.discard(work)


class AbortableWork(dist.Work):
    """One collective on the current generation's backend, left at once on an abort order.

    ``wait()`` polls the backend work and the abort signal; ``get_future()`` returns a future
    completed by the backend's own future or failed by :meth:`AbortSignal.fire`, whichever
    comes first. A backend work given up on goes to ``graveyard``.
    """

    def __init__(self, inner: dist.Work | None, signal: AbortSignal, graveyard: list[Any], what: str,
                 result: Any = None, finish: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self._inner, self._signal, self._graveyard, self._what = inner, signal, graveyard, what
        self._finish = finish  # run once the backend work succeeded; its return value is the result
        # A Future completed from Python with set_exception() is, to C++ callers (DDP's
        # reducer), a *successful* future holding an exception object; only a callback that
        # raises marks a future failed. So ours is a `then` of a trigger that carries
        # (value, error), and the callback raises the error.
        self._trigger: Future = Future()
        self._future: Future = self._trigger.then(_unwrap)
        self._done_lock = threading.Lock()
        self._completed = False
        self._error: BaseException | None = None
        if inner is None:  # completed locally (a detached group)
            self._complete(result, None)
            return
        if not signal._track(self):
            self._fail(CollectiveAborted(f"{what} issued after the abort order ({signal.reason})"))
            return
        try:
            inner_future = inner.get_future()
        except RuntimeError:  # gloo's _allgather_base/_reduce_scatter_base works have none:
            return            # they complete through wait() / is_completed() polling
        inner_future.add_done_callback(self._inner_done)

    def _complete(self, value: Any, error: BaseException | None) -> bool:
        with self._done_lock:
            if self._completed:
                return False
            self._completed, self._error = True, error
        self._trigger.set_result((value, error))
        return True

    def _inner_done(self, fut: Future) -> None:  # a gloo thread
        self._signal._untrack(self)
        try:
            value = fut.value()
        except Exception as err:  # noqa: BLE001 - a peer died: the op's error is the result
            self._fail(err)
            return
        self._succeed(value)

    def _succeed(self, value: Any) -> None:
        if self._finish is not None:
            value = self._finish()
        self._complete(value, None)

    def _fail(self, err: BaseException) -> None:
        # Seen through C++ (DDP's reducer) the error is a plain RuntimeError: the flag is how
        # the session tells a collective lost to a fault from a bug of the script's.
        self._signal.failed = True
        inner_pending = self._inner is not None and not self._inner.is_completed()
        if self._complete(None, err) and inner_pending:
            self._graveyard.append(self._inner)  # never dropped early: FACTS.md

    def is_completed(self) -> bool:
        if not self._completed and self._inner is not None and self._inner.is_completed():
            self._settle()
        return self._completed

    def _settle(self) -> None:
        """The backend work ended (seen by polling): take its result or error."""
        self._signal._untrack(self)
        try:
            self._inner.wait()
            value = self._inner_value()
        except Exception as err:  # noqa: BLE001 - the op's error is the result
            self._fail(err)
            return
        self._succeed(value)

    def _inner_value(self) -> Any:
        try:  # the future's value: Work.result() is deprecated (it warns once per process)
            return self._inner.get_future().value()
        except RuntimeError:  # works with no future (gloo's _allgather_base)
            return self._inner.result()

    def is_success(self) -> bool:
        return self._completed and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def wait(self, timeout: Any = None) -> bool:
        if self._inner is not None and not self._completed:
            try:
                wait_all([self._inner], self._signal.is_set, self._graveyard, self._what)
            except Exception as err:  # noqa: BLE001 - aborted, or the backend's error
                self._fail(err)
            else:
                self._settle()
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> Future:
        return self._future

    def result(self) -> Any:
        self.wait()
        return self._future.value()


class ThreadWaitedWork(dist.Work):
    """A gloo send/recv work, waited on by a daemon thread so that it can be polled.

    gloo's send and recv works complete only inside ``wait()``: ``is_completed()`` stays False
    until then (torch 2.13), so a polling wait on them never ends. The thread waits (until the
    op ends or fails, at the latest at the backend's timeout, keeping the work referenced that
    long: FACTS.md); :meth:`is_completed` reports what it saw. No future (like gloo's own).
    """

    def __init__(self, inner: dist.Work, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._inner, self._tensors = inner, tensors
        self._error: BaseException | None = None
        self._done = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="unbroken-p2p-wait").start()

    def _run(self) -> None:
        try:
            self._inner.wait()
        except Exception as exc:  # noqa: BLE001 - re-raised by wait() in the caller's thread
            self._error = exc
        finally:
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def wait(self, timeout: Any = None) -> bool:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> Future:
        raise RuntimeError("a point-to-point work has no future: it completes through wait()")

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._tensors


def _unwrap(trigger: Future) -> Any:
    value, error = trigger.value()
    if error is not None:
        raise error
    return value


def _first_tensors(args: tuple) -> list[torch.Tensor]:
    first = args[0]
    return first if isinstance(first, list) else [first]


class SurvivingGroup(dist.ProcessGroup):
    """A group of fixed ranks whose backend is the current generation's gloo group.

    Owned by one :class:`~unbroken.parallel.fabric.Fabric` (which builds it, attaches each
    generation's backend and holds the abort signal). ``global_ranks`` are the job ranks of
    its members, in group-rank order. ``before_reduce`` is called before each reduction is
    issued (the session marks its step's phase ``sync`` there).

    *Held* (:attr:`held`, set by the fabric): attached to a generation, but collectives
    complete locally as when detached. A replacement holds its groups while the script builds
    its wrappers (whose constructors issue collectives the busy survivors would not match),
    and releases them when it takes part in the state transfer.
    """

    def __init__(self, rank: int, size: int, global_ranks: list[int], key: str,
                 signal: AbortSignal, graveyard: list[Any],
                 before_reduce: Callable[[], None] | None = None) -> None:
        super().__init__(rank, size)
        self.global_ranks = list(global_ranks)
        self.key = key  # names its store prefix in each generation: gen<g>/<key>/
        self._signal, self._graveyard = signal, graveyard
        self._before_reduce = before_reduce
        self._backend: Any = None  # a ProcessGroupGloo (torch Backend) or None
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
        inner = getattr(self._backend, op)(*args)
        return AbortableWork(inner, self._signal, self._graveyard, what, finish=finish)

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
                                     result: list[torch.Tensor]) -> AbortableWork:
        """Reduce-scatter as an all-reduce of a copy, then this rank's chunk into ``output``.

        Why: gloo's reduce-scatter works (torch 2.13, list and tensor forms) fill the output but
        never report ``is_completed()``, not even after ``wait()``, and have no future, so an
        abortable (polling) wait on them never ends: FSDP2's backward hung there. Twice the
        traffic of a real reduce-scatter; the same sums on every run.
        """
        buf = flat.clone()
        ar_opts = dist.AllreduceOptions()
        ar_opts.reduceOp = opts.reduceOp
        ar_opts.timeout = opts.timeout

        def finish() -> list[torch.Tensor]:
            output.copy_(buf.view(self.size(), -1)[self.rank()].view_as(output))
            return result
        return self._issue("allreduce", ([buf], ar_opts), None, finish=finish)

    def reduce_scatter_tensor_coalesced(self, *args):
        return self._issue("reduce_scatter_tensor_coalesced", args, None)

    def broadcast(self, *args):
        return self._issue("broadcast", args, lambda: _first_tensors(args))

    def barrier(self, *args):
        return self._issue("barrier", args, lambda: [])

    def allgather(self, outputs, inputs, *rest):
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
        def local():
            for output, tensor in zip(outputs, inputs):
                output.view(-1, tensor.numel()).copy_(tensor.reshape(1, -1))
            return outputs
        return self._issue("allgather_into_tensor_coalesced", (outputs, inputs, *rest), local)

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
        inner = ThreadWaitedWork(getattr(self._backend, op)(tensors, peer, tag), tensors)
        return AbortableWork(inner, self._signal, self._graveyard, what)
