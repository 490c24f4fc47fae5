"""ShardedOptimizer on 4 real gloo ranks: bit-exactness across num_replicas, agreement with
a single-process torch optimizer, state dicts, memory, validation, and abort on a dead peer.

Each test is one launch of 4 processes that runs all its variants in sequence (startup
dominates on a 2-core machine).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from optim_launch import run_ranks, wait_for_files
from optim_model import NUM_PARAMS, OPTIMIZERS, STEPS, batch, build_model, flat_weights, loss_fn, lr_lambda

WORLD = 4


@pytest.fixture(scope="module")
def train_results(tmp_path_factory):
    return run_ranks("train", WORLD, tmp_path_factory.mktemp("train"), timeout_s=150)


def reference(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One process, plain torch optimizer, the 4 ranks' batches as one global batch."""
    torch.set_num_threads(1)
    cls, kwargs = OPTIMIZERS[name]
    model = build_model()
    opt = cls(model.parameters(), **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    losses = []
    for step in range(STEPS):
        xs, ys = zip(*(batch(step, r) for r in range(WORLD)))
        loss = loss_fn(model, torch.cat(xs), torch.cat(ys))  # mean over 4 equal batches = mean of means
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.detach())
    return flat_weights(model), torch.stack(losses)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_bit_identical_across_num_replicas_and_ranks(train_results, name):
    base = train_results[0][f"{name}_n4_weights"]
    for rank, res in enumerate(train_results):
        for n in (1, 2, 4):
            weights = res[f"{name}_n{n}_weights"]
            assert torch.equal(weights, base), (
                f"{name}: rank {rank} N={n} differs from rank 0 N=4 by {(weights - base).abs().max().item()}")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_matches_single_process_torch_optimizer(train_results, name):
    ref_weights, ref_losses = reference(name)
    assert not torch.equal(ref_weights, flat_weights(build_model())), "the reference did not train"
    for n in (1, 2, 4):
        losses = torch.stack([res[f"{name}_n{n}_losses"] for res in train_results])  # (rank, step)
        torch.testing.assert_close(losses.mean(dim=0), ref_losses, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(train_results[0][f"{name}_n{n}_weights"], ref_weights, rtol=1e-4, atol=1e-5)
    # The LR scheduler drove the sharded optimizer as it drives a plain one.
    assert train_results[0][f"{name}_n2_lr"] == pytest.approx(OPTIMIZERS[name][1]["lr"] * lr_lambda(STEPS))


@pytest.mark.timeout(200)
def test_phases_reported_per_step(train_results):
    phases = train_results[1]["adamw_n2_phases"]
    assert phases == [f"{p}:{s}" for s in range(STEPS) for p in ("sync", "update", "done")]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name,bytes_per_element", [("adamw", 8), ("sgd", 4)])
def test_optimizer_state_bytes_equal_formula(train_results, name, bytes_per_element):
    for rank, res in enumerate(train_results):
        for n in (1, 2, 4):
            expected = bytes_per_element * NUM_PARAMS * n // WORLD  # k * N/d * P
            assert res[f"{name}_n{n}_state_bytes"] == expected, (rank, n)
            assert res[f"{name}_n{n}_report_bytes"] == expected, (rank, n)
            assert res[f"{name}_n{n}_shard_numel"] == NUM_PARAMS * n // WORLD


@pytest.mark.timeout(200)
def test_state_dict_roundtrip_and_layout_change_continue_bit_identically(train_results):
    for rank, res in enumerate(train_results):
        uninterrupted = res["adamw_n2_weights"]
        assert torch.equal(res["resume_same_weights"], uninterrupted), rank
        assert torch.equal(res["resume_other_weights"], uninterrupted), rank  # N=4 -> N=1
        shard = rank % 2
        assert res["resume_same_meta"] == [WORLD, 2, shard, shard * 1152, (shard + 1) * 1152, 10]
        assert res["full_plain_loads"] is True
        assert res["full_step_count"] == 10
        assert res["full_keys"] == list(range(6))  # keyed like torch over model.parameters()


@pytest.mark.timeout(200)
def test_abort_during_gather_is_finished_on_a_new_group(train_results):
    for rank, res in enumerate(train_results):
        assert res["regroup_aborted"].startswith("5: parameter gather of step 5 aborted"), res["regroup_aborted"]
        assert "was updated but its parameter gather did not finish" in res["regroup_refused"]
        assert res["regroup_step_count_before_finish"] == 5
        assert res["regroup_step_count"] == STEPS
        assert torch.equal(res["regroup_weights"], res["adamw_n2_weights"]), rank


@pytest.mark.timeout(200)
def test_validation_errors_name_the_values(train_results):
    for res in train_results:
        errors = res["errors"]
        assert "num_replicas=3 does not divide the data-parallel world size 4" in errors["replicas_3"]
        assert "allowed: a divisor of 4 (1, 2, 4)" in errors["replicas_3"]
        assert "num_replicas=8 is larger than the data-parallel world size 4" in errors["replicas_8"]
        assert "num_replicas must be an int >= 1, got 0" in errors["replicas_0"]
        assert "not identical across ranks" in errors["not_identical"]
        assert "ranks [1, 2, 3] differ from rank 0" in errors["not_identical"]
        assert "new or replaced: ['extra (3,)']" in errors["added_param"], errors["added_param"]
        assert res["train_after_errors"] is True


@pytest.mark.timeout(240)
def test_survivors_abort_promptly_when_a_peer_is_killed_before_sync(tmp_path):
    victim = WORLD - 1
    flag_at = {}

    def kill_then_abort(procs):
        wait_for_files([tmp_path / "victim.ready"] + [tmp_path / f"sync.{r}" for r in range(victim)], 150)  # 4 imports of torch under load
        time.sleep(0.3)  # the survivors are now inside step(), blocked in the all-reduce
        # The abort order goes out as the peer dies (flag first: a survivor that sees gloo's
        # "connection reset" ~10 ms later must already find the order, whatever the scheduler does).
        (tmp_path / "abort.flag").touch()
        flag_at["t"] = time.time()
        os.kill(procs[victim].pid, signal.SIGKILL)

    results = run_ranks("abort", WORLD, tmp_path, timeout_s=180, while_running=kill_then_abort,
                        expect_killed=(victim,))
    for rank, res in enumerate(results[:victim]):
        assert res["outcome"] == "aborted", (rank, res)
        assert res["raised_at"] - flag_at["t"] < 2.0, "well under the gloo timeout"
        assert "gradient all-reduce of step 2" in res["message"]
        assert res["step_count"] == 2 and res["weights_unchanged"] is True  # nothing half-updated
    assert sum(res["abandoned"] for res in results[:victim]) >= 1  # pending work kept referenced
