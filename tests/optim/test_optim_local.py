"""ShardedOptimizer in one process (world size 1, no process group): the contract that
does not need peers -- equality with torch, schedulers, state dicts, validation."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from unbroken.errors import OptimizerError
from unbroken.optim import ShardedOptimizer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def model_and_data(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(9, 21), nn.Tanh(), nn.Linear(21, 5))
    return model, torch.randn(16, 9), torch.randn(16, 5)


def run(model, opt, x, y, steps, sched=None):
    for _ in range(steps):
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("cls,kwargs", [
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
])
def test_one_process_equals_plain_torch_bit_for_bit_with_a_scheduler(cls, kwargs):
    model, x, y = model_and_data()
    ref = copy.deepcopy(model)
    opt = ShardedOptimizer(model, cls, num_replicas=1, **kwargs)
    ref_opt = cls(ref.parameters(), **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.9 ** k)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda k: 0.9 ** k)
    run(model, opt, x, y, 7, sched)
    run(ref, ref_opt, x, y, 7, ref_sched)
    assert same(model, ref)
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == kwargs["lr"] * 0.9 ** 7
    assert opt.step_count == 7


def test_param_groups_frozen_params_and_full_state_dict_keyed_like_torch():
    model, x, y = model_and_data()
    model[0].bias.requires_grad_(False)
    groups = [{"params": [model[0].weight, model[0].bias], "weight_decay": 0.0},
              {"params": list(model[2].parameters()), "lr": 5e-3}]
    ref = copy.deepcopy(model)
    ref_groups = [{"params": [ref[0].weight, ref[0].bias], "weight_decay": 0.0},
                  {"params": list(ref[2].parameters()), "lr": 5e-3}]
    opt = ShardedOptimizer(groups, num_replicas=1, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref_groups, lr=1e-2)
    run(model, opt, x, y, 3)
    run(ref, ref_opt, x, y, 3)
    assert same(model, ref)
    full, plain = opt.full_state_dict(), ref_opt.state_dict()
    assert full["param_groups"] == plain["param_groups"]  # same indices, frozen one included
    assert sorted(full["state"]) == sorted(plain["state"]) == [0, 2, 3]
    for i, entry in plain["state"].items():
        for key, value in entry.items():
            assert torch.equal(full["state"][i][key], value), (i, key)


def test_full_state_dict_from_plain_torch_continues_bit_identically():
    model, x, y = model_and_data()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    run(ref, ref_opt, x, y, 4)
    model.load_state_dict(ref.state_dict())
    opt = ShardedOptimizer(model.parameters(), num_replicas=1, lr=1e-2)
    opt.load_full_state_dict(ref_opt.state_dict())
    assert opt.step_count == 4
    run(model, opt, x, y, 4)
    run(ref, ref_opt, x, y, 4)
    assert same(model, ref)


def test_shard_state_dict_roundtrip_and_refusals(tmp_path):
    model, x, y = model_and_data()
    opt = ShardedOptimizer(model, num_replicas=1, lr=1e-2)
    run(model, opt, x, y, 2)
    torch.save(opt.state_dict(), tmp_path / "shard.pt")
    sd = torch.load(tmp_path / "shard.pt", weights_only=True)
    assert sd["sharding"]["step_count"] == 2 and sd["sharding"]["shard_range"] == [0, 320]
    twin = copy.deepcopy(model)
    twin_opt = ShardedOptimizer(twin, num_replicas=1, lr=1e-2)
    twin_opt.load_state_dict(sd)
    sd["state"][0]["exp_avg"].fill_(7.0)  # the loaded state does not alias the caller's tensors
    run(model, opt, x, y, 3)
    run(twin, twin_opt, x, y, 3)
    assert same(model, twin)
    with pytest.raises(OptimizerError, match="no 'sharding' entry"):
        twin_opt.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())
    sd["sharding"]["world_size"] = 4
    with pytest.raises(OptimizerError, match="world_size: saved 4, here 1.*full_state_dict"):
        twin_opt.load_state_dict(sd)


def test_grads_are_averaged_views_after_sync_so_clipping_works():
    model, x, y = model_and_data()
    ref = copy.deepcopy(model)
    opt = ShardedOptimizer(model, torch.optim.SGD, num_replicas=1, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for m, o in ((model, opt), (ref, ref_opt)):
        (m(x) - y).pow(2).mean().backward()
        if o is opt:
            opt.sync_grads()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
        o.step()
        o.zero_grad(set_to_none=False)  # in place: the next backward accumulates into the buffer
    assert same(model, ref)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    for m, o in ((model, opt), (ref, ref_opt)):
        (m(x) - y).pow(2).mean().backward()
        o.step()
    assert same(model, ref)


def test_replaced_parameter_storage_is_taken_back_in():
    model, x, y = model_and_data()
    opt = ShardedOptimizer(model, num_replicas=1, lr=1e-2)
    model.load_state_dict(model_and_data(seed=1)[0].state_dict())  # copies into the flat views
    model[0].weight.data = torch.ones(21, 9)  # replaces the storage
    run(model, opt, x, y, 1)
    assert opt.full_state_dict()["state"][0]["exp_avg"].shape == (21, 9)
    assert model[0].weight.data_ptr() == opt._flat_param.data_ptr()


def test_construction_errors_name_the_values():
    model, _, _ = model_and_data()
    with pytest.raises(OptimizerError, match="num_replicas=2 is larger than the data-parallel world size 1"):
        ShardedOptimizer(model)  # the default N=2 needs at least 2 ranks
    with pytest.raises(OptimizerError, match="one dtype on one device.*float32.*float64"):
        ShardedOptimizer([model[0].weight, nn.Parameter(torch.zeros(3, dtype=torch.float64))], num_replicas=1)
    with pytest.raises(OptimizerError, match="bucket_bytes must be an int >= 1, got 0"):
        ShardedOptimizer(model, num_replicas=1, bucket_bytes=0)
    with pytest.raises(OptimizerError, match="no trainable parameters"):
        ShardedOptimizer([torch.zeros(3)], num_replicas=1)
    with pytest.raises(OptimizerError, match="not a leaf tensor"):
        ShardedOptimizer([model[0].weight * 2], num_replicas=1)
    with pytest.raises(OptimizerError, match="more than once"):
        ShardedOptimizer([model[0].weight, model[0].weight], num_replicas=1)
    opt = ShardedOptimizer(model, num_replicas=1)
    with pytest.raises(OptimizerError, match="cannot add parameter groups"):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})


def test_frozen_after_construction_is_refused_at_step():
    model, x, y = model_and_data()
    opt = ShardedOptimizer(list(model.parameters()), num_replicas=1)
    model[2].bias.requires_grad_(False)
    (model(x) - y).pow(2).mean().backward()
    with pytest.raises(OptimizerError, match=r"#3 \(5,\) was trainable at construction"):
        opt.step()


def test_memory_report_for_one_process():
    model, x, y = model_and_data()
    opt = ShardedOptimizer(model, num_replicas=1)
    run(model, opt, x, y, 1)
    report = opt.memory_report()
    assert report["num_params"] == 9 * 21 + 21 + 21 * 5 + 5 == 320
    assert report["optimizer_state_bytes"] == 8 * 320 and report["state_bytes_per_element"] == 8
    assert report["formula_optimizer_state_bytes"] == 8 * 320
    assert "4 + 16*N/d" in report["formula"]
