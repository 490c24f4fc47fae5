"""Stock DDP on a SurvivingGroup, 4 real gloo processes: a rank SIGKILLed mid all-reduce.

The survivors leave the broken all-reduce promptly, move the same group object to the next
generation together with a freshly started replacement, which receives module, optimizer
and DDP bucket layout from a survivor; training continues, every rank's final state equals
the fault-free run's bit for bit (BatchNorm buffers and ``no_sync`` accumulation included).
Slow (process starts: ~4 s here on quiet cores, much more under load).
"""

from __future__ import annotations

import pytest
import torch

from tests.parallel.dp_launch import run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_ddp_rank_killed_mid_all_reduce_recovers_in_flight_bit_exact(tmp_path):
    clean = run_job(tmp_path / "clean", steps=8, timeout_s=400)
    hit = run_job(tmp_path / "kill", steps=8, kill={1: 4}, timeout_s=400)
    for rank in range(4):
        assert _equal(clean.weights[rank], hit.weights[rank]) == [], f"rank {rank} differs from the fault-free run"
    for rank in (0, 2, 3):  # survivors: same process, one recovery at step 4, left promptly
        assert len(hit.spawned_pids[rank]) == 1 and hit.facts[rank]["pid"] == hit.spawned_pids[rank][0]
        [rec] = hit.facts[rank]["recoveries"]
        assert rec["step"] == 4
        assert rec["left_s"] < 2.0, rec  # out of the broken all-reduce (abort order or gloo's error)
    assert len(hit.spawned_pids[1]) == 2 and hit.facts[1]["first_gen"] == 1  # the replacement
    assert hit.facts[1]["pid"] == hit.spawned_pids[1][1]
