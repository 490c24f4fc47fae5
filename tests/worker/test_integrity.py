"""Damage checks of a live process: non-finite gradients and cross-replica bit sums."""

from __future__ import annotations

import pytest
import torch

from unbroken.errors import JobFailed, NonFiniteError, SilentCorruption
from unbroken.faults.inject import _flip_bit, poison_next_forward
from unbroken.worker import integrity


def model_with_grads(loss_scale: float = 1.0) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    (model(torch.ones(2, 4)).sum() * loss_scale).backward()
    return model


def test_finite_gradients_pass():
    integrity.check_finite({"model": model_with_grads()}, rank=0, step=3)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_loss_is_found_in_the_gradients(bad):
    model = model_with_grads(loss_scale=bad)
    with pytest.raises(NonFiniteError, match=r"rank 2: non-finite gradients in step 3 \(4 tensor"):
        integrity.check_finite({"model": model}, rank=2, step=3)


def test_huge_but_finite_gradients_pass_though_their_norm_overflows():
    integrity.check_finite({"model": model_with_grads(loss_scale=2.0 ** 100)}, rank=0, step=3)


def test_a_tracked_grad_scaler_owns_non_finite_gradients():
    """Scaled gradients overflow by design; the scaler's step skips them (a skipped step, not a fault)."""
    model = model_with_grads(loss_scale=float("inf"))
    integrity.check_finite({"model": model, "scaler": torch.amp.GradScaler("cpu")}, rank=0, step=3)
    with pytest.raises(NonFiniteError):
        integrity.check_finite({"model": model, "scaler": torch.amp.GradScaler("cpu", enabled=False)}, rank=0, step=3)


def test_the_nan_fault_poisons_exactly_one_forward():
    model = torch.nn.Linear(2, 2)
    poison_next_forward({"model": model})
    assert torch.isnan(model(torch.ones(2))).all()
    assert torch.isfinite(model(torch.ones(2))).all()


def test_any_single_flipped_bit_changes_the_bit_sum():
    t = torch.randn(1000)
    base = integrity.bit_sum(t)
    for bit in (0, 12, 22, 30, 31):
        flipped = t.clone()
        flipped.view(torch.int32)[517] ^= (1 << bit) if bit < 31 else -(1 << 31)
        assert integrity.bit_sum(flipped) != base, bit
    odd = torch.ones(3, dtype=torch.float16)  # 6 bytes: summed as bytes
    before = integrity.bit_sum(odd)
    _flip_bit(odd)
    assert integrity.bit_sum(odd) != before


def test_odd_ranks_against_the_majority():
    assert integrity.odd_ranks([[1, 2]] * 4) == ([], 4)
    assert integrity.odd_ranks([[1, 2], [1, 3], [1, 2], [1, 2]]) == ([1], 3)
    assert integrity.odd_ranks([[1], [2], [1], [2]])[1] == 2  # a tie: no majority


def replicas(world: int, flip_on: int | None):
    states = []
    for rank in range(world):
        model = model_with_grads()
        opt = torch.optim.AdamW(model.parameters())
        opt.step()
        if rank == flip_on:
            _flip_bit(opt.state[model[0].weight]["exp_avg"])
        states.append({"model": model, "opt": opt})
    return states


def check(states, rank):
    rows = [integrity.digests(integrity.replicated_tensors(s), torch.device("cpu")) for s in states]
    return integrity.check_replicas(states[rank], rank=rank, world_size=len(states), step=7,
                                    device=torch.device("cpu"), gather=lambda _local: rows)


def test_the_odd_copy_is_named_on_its_rank_and_reported_on_the_others():
    states = replicas(4, flip_on=2)
    with pytest.raises(SilentCorruption, match=r"rank 2: 1 tensor\(s\) differ from the copies of 3 of 4 ranks "
                                               r"after step 7 .*opt\.state\[0\]\.exp_avg"):
        check(states, 2)
    assert check(states, 0) == [2]
    assert check(replicas(4, flip_on=None), 1) == []


def test_no_majority_is_a_job_failure_not_a_repair():
    states = replicas(2, flip_on=1)
    with pytest.raises(JobFailed, match="no majority agrees"):
        check(states, 0)
