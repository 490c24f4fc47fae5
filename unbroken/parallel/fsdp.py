"""Keeping a stock FSDP2 module (``fully_shard``) consistent across a generation switch.

FSDP2 built on a mesh whose groups are :class:`~unbroken.parallel.group.SurvivingGroup` keeps
working when the groups move to a new generation; what needs care is a step cut in the middle:
a survivor's forward or backward left by a failed or aborted collective leaves parameter groups
unsharded, all-gather results and reduce-scatter states pending, and the root's per-iteration
trackers set. :func:`reset_after_abort` puts the module back to its sharded, idle state with
torch's own ``FSDPModule.reset_iter_state()`` (torch 2.13: the documented recovery after an
exception in forward or backward), after dropping the cut all-gathers whose works failed (the
reset would wait on them, and their wait re-raises the collective's error).

Private torch APIs used (torch 2.13): ``FSDPModule._get_fsdp_state()``, the state's
``_state_ctx.all_states`` and ``_fsdp_param_groups``, a param group's ``_all_gather_result``
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
    return len(roots)


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
