"""The step-start capture: what a dropped step puts back, and the per-rank part that travels.

At the start of every step under `unbroken run` the session captures every tracked object
that may change inside a step and is not covered by the commit rule (everything but modules,
torch optimizers and :class:`~unbroken.worker.api.RecoverableState` objects: schedulers,
samplers, loaders, tensors, user objects) and the RNG streams. When the step is dropped, the
survivor loads it back.

The per-rank part (the RNG streams and the per-rank objects) goes to the controller twice a
step, so that a replacement for this rank receives *its own* state: with the ``compute``
report (the start of the step) and with the commit report (after compute). It is encoded at
each read (:mod:`unbroken.state.blob`; never pickle), and those bytes are also the
survivor's copy; they travel only when they differ from the last ones this rank sent:
:class:`StepStates` otherwise reports "same" and the controller reuses its copy. On most steps
the start of step k equals the state after computing k - 1 (nothing per rank moves during an
update), so a step sends once, not twice. The replicated part (a scheduler, a tensor) is kept
as a :func:`snapshot`, a deep copy on its own device.

Pure functions and small classes; lives in the training thread of one rank.
"""

from __future__ import annotations

import logging
import math
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from unbroken.errors import CheckpointError, ConfigError
from unbroken.protocol.messages import PER_RANK_LIMIT_BYTES
from unbroken.state.blob import TreeEncoder, decode_tree, encode_tree, raw_bytes

log = logging.getLogger(__name__)

# -- copies and comparisons of state trees ---------------------------------------------------
_IMMUTABLE_LEAVES = frozenset({type(None), bool, int, float, str, bytes, torch.Size})
_EQUAL_BY_VALUE = frozenset({type(None), bool, int, str, bytes, torch.Size})  # float: see same()


def snapshot(x: Any, path: tuple = ()) -> Any:
    """A deep copy of a state tree that the training step cannot change: tensors cloned (on
    their device), containers and numpy arrays copied, immutable leaves shared. The leaves are
    those the state tree takes; CheckpointError naming the path for any other."""
    kind = type(x)
    if kind in _IMMUTABLE_LEAVES:
        return x
    if kind is dict or kind is OrderedDict:
        out = kind()
        for key, value in x.items():
            if type(key) not in (str, int):
                raise CheckpointError(f"cannot capture the dict at {_where(path)!r} of the step-start state: key "
                                      f"{key!r} has type {type(key).__qualname__}; only str and int keys are supported")
            out[key] = value if type(value) in _IMMUTABLE_LEAVES else snapshot(value, path + (key,))
        if kind is OrderedDict and getattr(x, "_metadata", None) is not None:
            out._metadata = snapshot(x._metadata, path + ("_metadata",))  # nn.Module state dicts
        return out
    if kind is list or kind is tuple:
        return kind([v if type(v) in _IMMUTABLE_LEAVES else snapshot(v, path + (i,)) for i, v in enumerate(x)])
    if isinstance(x, torch.Tensor):
        return (x.detach() if x.requires_grad else x).clone()
    np = sys.modules.get("numpy")  # a numpy object implies numpy is already imported
    if np is not None and isinstance(x, (np.ndarray, np.generic)) and not x.dtype.hasobject:
        return x.copy() if isinstance(x, np.ndarray) else x
    raise CheckpointError(f"cannot capture the value at {_where(path)!r} of the step-start state: type "
                          f"{kind.__module__}.{kind.__qualname__} is not supported (use tensors, numbers, str, "
                          "bytes, None, numpy arrays, and dict/list/tuple of those)")


def _where(path: tuple) -> str:
    return "/".join(str(p) for p in path) or "<root>"


def same(a: Any, b: Any) -> bool:
    """Whether two state trees are equal bit for bit: types, keys in order, tensors' dtype,
    shape, device and bytes (so 0.0 and -0.0 differ, and a NaN never equals anything)."""
    if a is b:  # the RNG forms a StreamReader reuses (never changed); immutable leaves
        return True
    kind = type(a)
    if kind is not type(b):
        return False
    if kind in _EQUAL_BY_VALUE:
        return a == b
    if kind is dict or kind is OrderedDict:
        if len(a) != len(b):
            return False
        for (key_a, value_a), (key_b, value_b) in zip(a.items(), b.items()):
            if type(key_a) is not type(key_b) or key_a != key_b:
                return False
            if value_a is not value_b and (type(value_a) not in _EQUAL_BY_VALUE or type(value_a) is not type(value_b)
                                           or value_a != value_b) and not same(value_a, value_b):
                return False
        return kind is dict or same(getattr(a, "_metadata", None), getattr(b, "_metadata", None))
    if kind is list or kind is tuple:
        return len(a) == len(b) and all(same(value_a, value_b) for value_a, value_b in zip(a, b))
    if kind is float:
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and _same_bytes(a, b)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(a, (np.ndarray, np.generic)):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return bool(a == b)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not (a.dtype.is_floating_point or a.dtype.is_complex):
        return torch.equal(a, b)  # integers and bools: equal values are equal bytes
    if a.is_cpu:
        return raw_bytes(a) == raw_bytes(b)
    return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


# -- the capture and the reports -----------------------------------------------------------
@dataclass(frozen=True)
class StepCapture:
    """One rank's state at the start of ``step`` (see the module docstring): the replicated part
    as its encoding (bytes) or, when it holds device tensors, a snapshot, and the encoding of the
    per-rank part; never loaded as they are (a load that kept a reference would let the redo
    change them)."""

    step: int
    local_state: dict[str, Any] | bytes
    per_rank_blob: bytes

    def local(self) -> dict[str, Any]:
        if isinstance(self.local_state, bytes):
            return decode_tree(self.local_state, f"the replicated state of step {self.step}'s start")
        return snapshot(self.local_state)

    def per_rank_tree(self) -> dict[str, Any]:
        return decode_tree(self.per_rank_blob, f"the per-rank state of step {self.step}'s start")


def capture(step: int, local: dict[str, Any], per_rank: dict[str, Any]) -> StepCapture:
    """Capture the trees of one step start (the step mutates the originals)."""
    return StepCapture(step, snapshot(local), encode_tree(per_rank))


class Report(NamedTuple):
    """What a progress report carries of the rank's own state: its encoding, or ``same``."""

    state: bytes
    same: bool


NO_REPORT = Report(b"", False)
SAME = Report(b"", True)


class StepStates:
    """One rank's step-start capture and the per-rank state it last sent to the controller, so
    that an unchanged one is reported as ``same`` instead of sent again (the controller keeps
    the bytes it has).

    The per-rank state is encoded at each read: the encoding is at once the copy a dropped step
    loads back (decoded only then), the bytes that travel, and the comparison with the last one
    sent (equal bytes are equal states bit for bit: types, key order, a float's sign, a tensor's
    dtype, shape and bytes). The RNG streams' captured forms never change (the reader makes a
    new one when a stream moves), so their encodings are reused while they stay the same.

    Lives in the training thread of one rank, owned by its session (under `unbroken run`). The
    controller notes every report of a process in order (one connection), so "the last one
    sent" is the same state on both sides; a new process starts with none.
    """

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._encoder = TreeEncoder()
        self._local_encoder: TreeEncoder | None = TreeEncoder(cpu_only=True)  # None: snapshots (see _keep_local)
        self._last_sent: bytes | None = None  # the encoding of the last state sent
        self._checked = False  # the per-rank tree was checked once to hold only what checkpoints take
        self.capture: StepCapture | None = None  # the start of the step in flight
        self.start_report = NO_REPORT  # ... its per-rank part, for the 'compute' report
        self._at_sync: bytes | None = None  # ... its per-rank part as its reduction began (a vote-less step)
        self._after: bytes | None = None  # the state after the previous step's compute, until this one begins
        #: The first step after whose update this rank's own state moved (its next start differed), or None
        self.moved_after_update: int | None = None
        #: Why this rank's state at a cut inside a reduction need not be its state after compute (sticky):
        #: once its state moved between a step's reduction and its update (a draw there, GradScaler.unscale_).
        self._sync_moved = ""

    def begin(self, step: int, local: dict[str, Any], per_rank: dict[str, Any]) -> None:
        """Capture the start of ``step`` (trees from TrackedState.step_start) and its report."""
        blob = self._encode(per_rank)
        self.start_report = self.report_of(blob)
        self.capture = StepCapture(step, self._keep_local(local), blob)
        self._at_sync = None
        if self._after is not None and blob != self._after and self.moved_after_update is None:
            self.moved_after_update = step - 1  # (the controller sees it in consecutive reports, where both travel)
        self._after = None

    def at_sync(self, per_rank: dict[str, Any]) -> bytes | None:
        """The state as the step's reduction begins, in a step committed without a vote (worker/commit.py);
        returns its encoding where it stands for the state after compute (as :meth:`at_cut` tells)."""
        self._at_sync = self._encode(per_rank)
        return None if self._sync_moved else self._at_sync

    @property
    def in_sync(self) -> bool:
        """Whether the step in flight took :meth:`at_sync`."""
        return self._at_sync is not None

    def at_cut(self, per_rank: dict[str, Any]) -> tuple[bytes | None, str]:
        """Cut inside the reduction: ``(state, "")`` with this rank's state if it is its state after the
        step's compute (the same at the reduction's start and now, and never seen to move between a
        reduction and the update before), else ``(None, why not)``."""
        if self._at_sync is None:
            return None, "its state at the start of the reduction was not taken"
        if self._sync_moved:
            return None, self._sync_moved
        if self._encode(per_rank) != self._at_sync:
            return None, "its own state moved inside the reduction"
        return self._at_sync, ""

    def after_compute(self, per_rank: dict[str, Any], *, report: bool = True) -> Report | None:
        """The report of the state after the step's compute (a tree from TrackedState.per_rank_tree); with
        ``report=False`` none, where the state stands as :meth:`at_sync` took it: the step's commit report
        is then not sent (worker/step_boundary.py), and None is returned if it does not stand."""
        blob = self._after = self._encode(per_rank)
        if self._at_sync is not None and blob != self._at_sync and not self._sync_moved:
            step = self.capture.step if self.capture is not None else -1
            self._sync_moved = (f"its own state moved between the start of step {step}'s reduction and its update "
                                "(a draw there, GradScaler.unscale_, a forward)")
            log.warning("rank %d: %s; a fault that cuts its reduction while a peer updates is recovered by a "
                        "restart from the newest checkpoint, not in flight", self._rank, self._sync_moved)
        if not report and blob == self._at_sync:
            return None
        return self.report_of(blob)

    def _keep_local(self, local: dict[str, Any]) -> dict[str, Any] | bytes:
        """The replicated part's copy: its encoding (C code, several times faster than a snapshot's
        walk in Python) while it holds CPU values only; a snapshot from the first read that holds a
        device tensor (kept on its device) or a value the encoder lacks (the snapshot names it)."""
        if self._local_encoder is not None:
            try:
                return self._local_encoder.encode(local)
            except CheckpointError:
                self._local_encoder = None
        return snapshot(local)

    def report_of(self, blob: bytes) -> Report:
        """``blob`` (an encoding this made) as it travels: itself, or SAME where it is the one last sent."""
        if blob == self._last_sent:
            return SAME
        self._last_sent = blob
        return Report(blob, False)

    def _encode(self, per_rank: dict[str, Any]) -> bytes:
        """Encode a per-rank tree; CheckpointError naming the path of a value checkpoints cannot
        hold (checked in full on the first read), ConfigError if it is over the travel limit."""
        if not self._checked:
            snapshot(per_rank)  # the first read: the error names the path (the encoder's cannot)
            self._checked = True
        try:
            blob = self._encoder.encode(per_rank, _stream_tensors(per_rank["rng"]))
        except CheckpointError:
            snapshot(per_rank)  # a value of another kind appeared: name its path
            raise
        if len(blob) > PER_RANK_LIMIT_BYTES:
            raise ConfigError(_too_big(per_rank, len(blob), self._rank))
        return blob


def _stream_tensors(streams: dict[str, Any]) -> tuple[Any, ...]:
    """The tensors of the RNG streams' captured forms that rng.StreamReader reuses while a stream
    does not move (its torch form when that is a tensor, and the words of Python's and numpy's):
    never changed."""
    numpy = streams.get("numpy")
    forms = (streams["torch"], streams["python"][1]) + ((numpy[1],) if numpy is not None else ())
    return tuple(form for form in forms if isinstance(form, torch.Tensor))


def _too_big(per_rank: dict[str, Any], total_bytes: int, rank: int) -> str:
    sizes = {}
    for name, state in per_rank.get("objects", {}).items():
        try:
            sizes[name] = len(encode_tree(state))
        except CheckpointError:
            sizes[name] = 0
    buffers = {name: sum(t.numel() * t.element_size() for t in held.values())
               for name, held in per_rank.get("buffers", {}).items()}
    biggest = max(sizes, key=sizes.__getitem__) if sizes else "rng"
    if buffers and max(buffers.values()) > sizes.get(biggest, 0):
        module = max(buffers, key=buffers.__getitem__)
        return (f"rank {rank}: the per-rank state is {total_bytes} bytes, over the {PER_RANK_LIMIT_BYTES}-byte "
                f"limit (it is copied to the controller every step); the biggest part is the buffers of the "
                f"tracked module {module!r} ({buffers[module]} bytes: a forward may move them, so they travel "
                f"with each rank's own state). Register the buffers that never change with persistent=False "
                f"(they are then not state: neither checkpointed nor copied)")
    return (f"rank {rank}: the per-rank state is {total_bytes} bytes, over the {PER_RANK_LIMIT_BYTES}-byte "
            f"limit (it is copied to the controller every step); the biggest is {biggest!r} "
            f"({sizes.get(biggest, total_bytes)} bytes). Mark big objects replicated when every rank holds the "
            f"same: job.track(..., replicated=[{biggest!r}])")
