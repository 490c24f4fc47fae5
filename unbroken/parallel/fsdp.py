"""Keeping a stock FSDP2 module (``fully_shard``) consistent across a generation switch.

FSDP2 built on a mesh whose groups are :class:`~unbroken.parallel.group.SurvivingGroup` keeps
working when the groups move to a new generation; what needs care is a step cut in the middle:
a survivor's forward or backward left by a failed or aborted collective leaves parameter groups
unsharded, all-gather results and reduce-scatter states pending, and the root's per-iteration
trackers set. :func:`reset_after_abort` puts the module back to its sharded, idle state with
torch's own ``FSDPModule.reset_iter_state()`` (torch 2.13: the documented recovery after an
exception in forward or backward), after dropping the cut all-gathers whose works failed (the
reset would wait on them, and their wait re-raises the collective's error), and then drops the
gradients the cut step accumulated without reducing them. Why: with gradient accumulation
(``set_requires_gradient_sync(False)`` on all but the last micro-batch) FSDP2 keeps each
micro-batch's gradient on the *unsharded* parameter (``_unsharded_param.grad``, or
``unsharded_accumulated_grad`` with a reduce dtype) until the last micro-batch's backward
reduce-scatters it; ``reset_iter_state()`` leaves them there, and ``zero_grad()`` reaches only the
sharded parameters, so the redone step's first micro-batch would add to the dropped step's sum
(issue 32, case 4: silently different weights).

Private torch APIs used (torch 2.13): ``FSDPModule._get_fsdp_state()``, the state's
``_state_ctx.all_states`` and ``_fsdp_param_groups``, a param group's ``_all_gather_result``
and ``fsdp_params``, an FSDPParam's ``_unsharded_param`` and ``unsharded_accumulated_grad``,
and the root's ``_comm_ctx.all_gather_state``.

Runs in the training thread of one rank.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def _fsdp_module_class() -> type | None:
    """FSDPModule, if FSDP2 is imported (a script using it has imported it)."""
    module = sys.modules.get("torch.distributed.fsdp._fully_shard._fully_shard")
    return getattr(module, "FSDPModule", None)


def root_modules(module: torch.nn.Module) -> list[Any]:
    """The FSDP2 roots in ``module``'s tree (the outermost ``fully_shard``-ed modules)."""
    fsdp_module = _fsdp_module_class()
    if fsdp_module is None:
        return []
    roots: list[Any] = []
    for sub in module.modules():
        if isinstance(sub, fsdp_module) and not any(sub in set(r.modules()) for r in roots):
            roots.append(sub)
    return roots


def reset_after_abort(module: torch.nn.Module) -> int:
    """Put every FSDP2 root of ``module`` back to sharded and idle; returns how many were reset."""
    roots = root_modules(module)
    for root in roots:
        state = root._get_fsdp_state()
        if not state._state_ctx.all_states:
            continue  # never ran a forward: nothing is cut
        _drop_cut_all_gathers(state)
        root.reset_iter_state()
        _drop_accumulated_grads(state)
    return len(roots)


def _drop_accumulated_grads(root_state: Any) -> None:
    """Forget the unreduced gradients micro-batches of the cut step accumulated (see the module docstring)."""
    for state in root_state._state_ctx.all_states:
        for group in state._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                fsdp_param.unsharded_accumulated_grad = None
                unsharded = getattr(fsdp_param, "_unsharded_param", None)  # made at the first forward
                if unsharded is not None:
                    unsharded.grad = None


def _drop_cut_all_gathers(root_state: Any) -> None:
    """Forget all-gathers whose work did not succeed (their buffers are not used again)."""
    for state in root_state._state_ctx.all_states:
        for group in state._fsdp_param_groups:
            result = group._all_gather_result
            if result is not None and not _succeeded(result.all_gather_work):
                group._all_gather_result = None
    comm = root_state._comm_ctx
    if comm.all_gather_state is not None:
        comm.all_gather_state = None


def _succeeded(work: Any) -> bool:
    if work is None:
        return True
    try:
        return bool(work.is_completed() and work.is_success())
    except RuntimeError:
        return False
