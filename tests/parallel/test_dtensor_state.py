"""Sharded (DTensor) state: local shards out and back, and the replica classes (one process, fast)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from unbroken.errors import CheckpointError
from unbroken.parallel import dtensor_state, fsdp
from unbroken.worker.tracked import TrackedState

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _sharded(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt, steps: int) -> None:
    for step in range(steps):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_local_shards_round_trip_into_a_fresh_fsdp_module_and_optimizer_bit_exact(world_of_one):
    from torch.distributed.tensor import DTensor

    model, opt = _sharded(0)
    _train(model, opt, 3)
    tracked = TrackedState()
    model_state, opt_state = tracked.state_of(model), tracked.state_of(opt)
    every = [*model_state.values(), *opt_state["state"][0].values()]
    assert every and not any(isinstance(t, DTensor) for t in every)  # local tensors only, no gather

    fresh, fresh_opt = _sharded(1)  # other initial weights, an empty optimizer
    tracked.load_one(fresh, _copied(model_state))  # as a checkpoint or a transfer brings them: new tensors
    tracked.load_one(fresh_opt, _copied(opt_state))
    assert all(isinstance(v, DTensor) for v in fresh_opt.state[next(fresh.parameters())].values()
               if v.dim() > 0)  # moments laid out like their parameter again
    _train(model, opt, 2)
    _train(fresh, fresh_opt, 2)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a.to_local(), b.to_local()), name


def _copied(tree):
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _copied(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copied(v) for v in tree]
    return tree


def test_loading_a_shard_of_another_shape_names_the_key(world_of_one):
    model, _ = _sharded(0)
    state = TrackedState().state_of(model)
    state["2.weight"] = torch.zeros(5, 5)
    with pytest.raises(CheckpointError, match=r"'2.weight'.*\(5, 5\).*\(2, 8\)"):
        dtensor_state.load_module(model, state)


def test_reset_after_a_cut_forward_leaves_the_module_sharded_and_trainable(world_of_one):
    model, opt = _sharded(0)
    _train(model, opt, 1)
    with pytest.raises(RuntimeError, match="cut"):
        def cut(*_):
            raise RuntimeError("cut mid-forward")
        handle = model[2].register_forward_pre_hook(cut)
        try:
            model(torch.randn(3, 4))
        finally:
            handle.remove()
    def states():
        root = model._get_fsdp_state()
        return {(g._sharded_state.name, g._training_state.name) for st in root._state_ctx.all_states
                for g in st._fsdp_param_groups}
    assert ("UNSHARDED", "FORWARD") in states()  # the cut left a parameter group gathered, mid-forward
    assert fsdp.reset_after_abort(model) == 1
    assert states() == {("SHARDED", "IDLE")}
    _train(model, opt, 1)  # the next step runs normally


def _accumulated_step(model, opt, step: int, cut: bool = False) -> None:
    """Two micro-batches, the gradient reduced on the second only; ``cut``: the step is cut in the
    second micro-batch's forward (a lost peer's all-gather), after the first one's backward."""
    for micro in range(2):
        model.set_requires_gradient_sync(micro == 1)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step * 10 + micro))
        if cut and micro == 1:
            def fail(*_):
                raise RuntimeError("cut mid-forward")
            handle = model[2].register_forward_pre_hook(fail)
            try:
                with pytest.raises(RuntimeError, match="cut"):
                    model(x)
            finally:
                handle.remove()
            return
        model(x).square().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_a_step_cut_between_micro_batches_leaves_no_accumulated_gradient_for_the_redo(world_of_one):
    """set_requires_gradient_sync(False) keeps the first micro-batch's gradient on the unsharded
    parameters, where neither reset_iter_state() nor zero_grad() reaches; a dropped step must not leave it."""
    want, want_opt = _sharded(0)
    for step in range(3):
        _accumulated_step(want, want_opt, step)
    model, opt = _sharded(0)
    _accumulated_step(model, opt, 0)
    _accumulated_step(model, opt, 1, cut=True)  # dropped: what a survivor does next
    model.zero_grad(set_to_none=True)  # as the session drops a cut step's gradients
    assert fsdp.reset_after_abort(model) == 1
    for step in (1, 2):  # the redo, then one more
        _accumulated_step(model, opt, step)
    for (name, a), b in zip(want.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a.to_local(), b.to_local()), name


def test_replica_classes_of_hsdp_match_the_replica_map_blocks_and_a_transposed_mesh_does_not():
    hsdp = [(("c", 0),), (("c", 1),), (("c", 0),), (("c", 1),)]  # mesh (2, 2): rank r holds shard r % 2
    assert dtensor_state.num_replicas(hsdp) == 2
    assert dtensor_state.holders_by_class(hsdp) == {(("c", 0),): [0, 2], (("c", 1),): [1, 3]}
    assert dtensor_state.replica_layout_problem(hsdp) == ""
    transposed = [(("c", 0),), (("c", 0),), (("c", 1),), (("c", 1),)]
    assert "replicate dimension first" in dtensor_state.replica_layout_problem(transposed)
    pure = [(("c", r),) for r in range(4)]
    assert dtensor_state.num_replicas(pure) == 1 and dtensor_state.replica_layout_problem(pure) == ""
