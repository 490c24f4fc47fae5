"""Carrying out injected faults inside a worker: real faults, fired once per job.

The worker session calls :meth:`FaultInjector.at` at every phase of every step. A fault
whose (rank, step, phase) matches is *claimed* first (from the controller under
`unbroken run`, from a marker file in the run directory otherwise) so that it fires once
per job, not again after a restart; then it happens for real: SIGKILL, a loop that stops
making progress, an exception, an exit code, damaged bytes in the tracked state (`corrupt`,
reported as a device reports an uncorrectable memory error; `flip`, silent), a NaN loss, or
a sub-health report.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch

from unbroken.errors import DeviceMemoryError, InjectedFault
from unbroken.faults.plan import Fault, FaultKind

log = logging.getLogger(__name__)

Claim = Callable[[Fault], bool]


def file_claim(run_dir: str | os.PathLike | None) -> Claim:
    """A claim that survives restarts through a marker file per fault (no controller needed).

    Without a run directory, a fault is claimed once per process.
    """
    fired: set[str] = set()

    def claim(fault: Fault) -> bool:
        if run_dir is None:
            if fault.fault_id in fired:
                return False
            fired.add(fault.fault_id)
            return True
        marker_dir = Path(run_dir) / "faults-fired"
        marker_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        name = fault.fault_id.replace(":", "_").replace("=", "-").replace("/", "_")
        try:
            fd = os.open(marker_dir / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return False
        os.close(fd)
        return True

    return claim


class FaultInjector:
    """Fires this rank's faults of a plan at the matching step and phase."""

    def __init__(self, faults: Iterable[Fault], rank: int, claim: Claim,
                 tracked: Callable[[], Mapping[str, Any]] | None = None,
                 degraded: Callable[[str], None] | None = None) -> None:
        self._pending = [f for f in faults if f.rank == rank]
        self._claim = claim
        self._tracked = tracked  # the training state that corrupt, flip and nan faults damage
        self._degraded = degraded  # reports this rank degraded (a subhealth fault)
        self.rank = rank

    def at(self, step: int, phase: str) -> None:
        for fault in self._pending:
            if fault.step == step and fault.at == phase:
                self._pending.remove(fault)
                if self._claim(fault):
                    self._fire(fault)
                return

    def _fire(self, fault: Fault) -> None:
        log.warning("rank %d: injecting fault %s", self.rank, fault)
        kind = fault.kind
        if kind is FaultKind.KILL:
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # SIGKILL is asynchronous; never continue past it
        elif kind is FaultKind.HANG:
            # A hang: the process stays alive (heartbeats go on) but the loop makes no progress.
            while True:
                time.sleep(3600)
        elif kind is FaultKind.RAISE:
            raise InjectedFault(f"injected fault {fault} (rank {self.rank}, step {fault.step})")
        elif kind is FaultKind.EXIT:
            sys.stdout.flush()
            os._exit(fault.exit_code)
        elif kind is FaultKind.CORRUPT and self._tracked is not None:
            # As a device reports an uncorrectable memory error: the bytes are really damaged,
            # and the error names the rank and the tensors.
            what = fault.corrupt_target
            hit = damage_tracked(self._tracked(), what)
            raise DeviceMemoryError(f"rank {self.rank}: uncorrectable memory error in {what} "
                                    f"({', '.join(hit) or 'nothing to damage'}), injected by {fault}")
        elif kind is FaultKind.FLIP and self._tracked is not None:
            hit = damage_tracked(self._tracked(), fault.corrupt_target, _flip_bit)  # silently: no error
            log.warning("rank %d: flipped one bit of %s", self.rank, ", ".join(hit) or "nothing")
        elif kind is FaultKind.NAN and self._tracked is not None:
            poison_next_forward(self._tracked())
        elif kind is FaultKind.SUBHEALTH and self._degraded is not None:
            self._degraded(f"injected by {fault}")
        else:
            raise InjectedFault(f"fault kind {kind.value!r} ({fault}) is not supported by this version")


def damage_tracked(tracked: Mapping[str, Any], what: str,
                   damage: Callable[[torch.Tensor], None] | None = None) -> list[str]:
    """For a `corrupt` (or `flip`) fault: really damage the first tensor of ``what`` (params,
    optimizer state or grads) among the tracked objects; return the names of what was hit.
    ``damage`` does it (default: overwrite the first eighth with 1e30)."""
    damage = damage or _overwrite
    for name, obj in tracked.items():
        if what in ("params", "grads") and isinstance(obj, torch.nn.Module):
            for pname, p in obj.named_parameters():
                t = p.grad if what == "grads" else p.data
                if t is not None and t.numel() > 1:
                    damage(t)
                    return [f"{name}.{pname}" + (".grad" if what == "grads" else "")]
        if what == "optimizer" and isinstance(obj, torch.optim.Optimizer):
            for index, state in enumerate(obj.state.values()):
                for key, t in state.items():
                    if isinstance(t, torch.Tensor) and t.numel() > 1:
                        damage(t)
                        return [f"{name}.state[{index}].{key}"]
    return []


def _overwrite(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.view(-1)[: max(1, t.numel() // 8)] = 1e30


def _flip_bit(t: torch.Tensor) -> None:
    """Flip one bit (bit 12 of the first 32-bit word: a low mantissa bit of an fp32 value)."""
    with torch.no_grad():
        t.view(-1).view(torch.uint8)[:4].view(torch.int32).bitwise_xor_(1 << 12)


def poison_next_forward(tracked: Mapping[str, Any]) -> None:
    """For a `nan` fault: the next forward of the first tracked module returns NaN in every
    floating-point output (so the loss is NaN, and after backward, the gradients)."""
    module = next((obj for obj in tracked.values() if isinstance(obj, torch.nn.Module)), None)
    if module is None:
        return

    def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> Any:
        handle.remove()
        return _poison(output)

    handle = module.register_forward_hook(hook)


def _poison(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value * float("nan") if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_poison(v) for v in value)
    if isinstance(value, dict):
        return {k: _poison(v) for k, v in value.items()}
    return value
