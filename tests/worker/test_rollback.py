"""Replicated vs per-rank state, and the step-start capture a dropped step puts back."""

from __future__ import annotations

import json
import random

import pytest
import torch

from unbroken.errors import CheckpointCorrupt, CheckpointError, ConfigError
from unbroken.state import blob
from unbroken.worker import rollback
from unbroken.worker.api import SessionHooks
from unbroken.worker.tracked import TrackedState

HOOKS = SessionHooks(on_phase=lambda name, step: None, should_abort=lambda: False, defer_completion=False)


class Position:
    """A user object with state that moves inside a step."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position, "buffer": torch.arange(3) + self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def _tracked() -> TrackedState:
    tracked = TrackedState()
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for name, obj in dict(model=model, opt=opt, sched=torch.optim.lr_scheduler.StepLR(opt, 2),
                          data=Position(), ema=torch.zeros(2)).items():
        tracked.add(name, obj, HOOKS)
    return tracked


def test_objects_the_commit_rule_does_not_cover_are_per_rank_by_default():
    tracked = _tracked()
    assert tracked.per_rank == {"data"}
    assert [n for n, _ in tracked.plain()] == ["model", "opt", "sched", "ema"]
    assert sorted(tracked.rollback_tree()) == ["ema", "sched"]  # data rolls back in the per-rank part
    tracked.classify(per_rank=["sched"], replicated=["data"])
    assert tracked.per_rank == {"sched"}


@pytest.mark.parametrize("per_rank,replicated,words", [
    (["model"], [], "cannot be per rank"), (["ema"], [], "cannot be per rank"),
    (["nope"], [], "not a tracked object"), (["data"], ["data"], "both"), ("data", [], "not the string")])
def test_a_bad_override_is_a_config_error_naming_it(per_rank, replicated, words):
    with pytest.raises(ConfigError, match=words):
        _tracked().classify(per_rank, replicated)


def test_a_dropped_step_gets_its_start_back_exactly():
    tracked = _tracked()
    random.seed(5)
    torch.manual_seed(5)
    capture = rollback.capture(3, tracked.rollback_tree(), tracked.per_rank_tree())
    want = (torch.rand(4), random.random())
    tracked.objects["data"].position += 8  # the step moves everything
    tracked.objects["ema"].add_(1.0)
    tracked.objects["sched"].step()
    tracked.load_rollback(capture.local(), capture.per_rank_tree())
    assert tracked.objects["data"].position == 0
    assert tracked.objects["ema"].tolist() == [0.0, 0.0]
    assert tracked.objects["sched"].last_epoch == 0
    got = (torch.rand(4), random.random())
    assert torch.equal(got[0], want[0]) and got[1] == want[1]


def test_per_rank_state_over_the_limit_names_the_biggest_object(monkeypatch):
    tracked = _tracked()
    monkeypatch.setattr(rollback, "PER_RANK_LIMIT_BYTES", 1000)
    with pytest.raises(ConfigError, match=r"over the 1000-byte limit.*'data'.*replicated=\['data'\]"):
        rollback.StepStates(rank=2).begin(0, *tracked.step_start())


def test_a_tree_round_trips_exactly():
    tree = {"a": [1, (2, 3.5)], "t": torch.ones(2), "bf": torch.arange(4, dtype=torch.bfloat16).reshape(2, 2),
            "empty": torch.empty(0, 3), "c": torch.tensor([1 + 2j])}
    back = blob.decode_tree(blob.encode_tree(tree), "x")
    assert back["a"] == [1, (2, 3.5)]
    for key in ("t", "bf", "empty", "c"):
        assert back[key].dtype == tree[key].dtype and torch.equal(back[key], tree[key]), key


def _blob_with(header: dict, tail: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + tail


@pytest.mark.parametrize("data", [
    b"\x0a\x00\x00\x00\x00\x00\x00\x00{not json}", b"\x01\x02", b"\xff" * 8 + b"{}",
    _blob_with({"format": "other"}),
    _blob_with({"format": "unbroken-state-blob-1", "spec": {}, "tensors": [["x", "os", [1], 1]]}, b"\x00"),
    _blob_with({"format": "unbroken-state-blob-1", "spec": {}, "tensors": [["x", "float32", [4], 16]]}, b"\x00"),
    blob.encode_tree({"x": torch.ones(2)}) + b"\x00",
], ids=["not-json", "short", "length-past-end", "format", "not-a-dtype", "truncated", "trailing"])
def test_bytes_that_are_not_an_encoded_state_are_refused(data):
    with pytest.raises(CheckpointCorrupt, match="per-rank state"):
        blob.decode_tree(data, "per-rank state")


class DrawsOnRead(Position):
    """Like a StatefulDataLoader without a live iterator: reading its state draws from the RNG."""

    def state_dict(self) -> dict:
        torch.rand(2)
        random.random()
        return super().state_dict()


def test_reading_the_state_never_moves_the_rng_streams():
    tracked = _tracked()
    tracked.add("loader", DrawsOnRead(), HOOKS)
    torch.manual_seed(9)
    random.seed(9)
    want = (torch.rand(3), random.random())
    torch.manual_seed(9)
    random.seed(9)
    local, per_rank = tracked.step_start()
    tracked.tree()
    tracked.per_rank_tree()
    got = (torch.rand(3), random.random())
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
    assert sorted(local) == ["ema", "sched"] and sorted(per_rank["objects"]) == ["data", "loader"]


def test_an_unchanged_per_rank_state_is_sent_once_and_the_controller_reuses_it():
    from unbroken.controller.rank_state import Point, RankStates
    tracked, states, kept = _tracked(), rollback.StepStates(rank=1), RankStates(limit_bytes=1 << 20)
    torch.manual_seed(3)
    states.begin(0, *tracked.step_start())
    assert not states.start_report.same and states.start_report.state  # the first is always sent
    kept.note_report(1, 0, 0, Point.START, states.start_report.state, same=states.start_report.same)
    after = states.after_compute(tracked.per_rank_tree())
    assert after.same  # nothing moved during the compute
    kept.note_report(1, 0, 0, Point.AFTER_COMPUTE, after.state, same=after.same)
    tracked.objects["data"].position += 8
    torch.rand(1)  # the step moves the position and the stream
    after = states.after_compute(tracked.per_rank_tree())
    assert not after.same
    kept.note_report(1, 0, 0, Point.AFTER_COMPUTE, after.state, same=False)
    states.begin(1, *tracked.step_start())  # the update moved nothing per rank
    assert states.start_report.same
    kept.note_report(1, 0, 1, Point.START, states.start_report.state, same=states.start_report.same)
    got = blob.decode_tree(kept.for_resume(1, 0, 1).state, "x")
    want = tracked.per_rank_tree()
    assert got["objects"]["data"]["position"] == 8 and rollback.same(got["rng"]["torch"], want["rng"]["torch"])
    tracked.objects["data"].position += 1
    states.begin(2, *tracked.step_start())  # moved outside a compute: sent again
    assert not states.start_report.same


def test_a_same_report_without_a_kept_state_keeps_nothing():
    from unbroken.controller.rank_state import Point, RankStates
    kept = RankStates(limit_bytes=100)
    kept.note_report(0, 0, 4, Point.START, b"", same=True)
    assert kept.for_resume(0, 0, 4) is None
    kept.note_report(0, 0, 4, Point.START, b"s4", same=False)
    kept.note_report(0, 1, 5, Point.START, b"", same=True)  # a new attempt: the old bytes are not its own
    assert kept.for_resume(0, 1, 5) is None


@pytest.mark.parametrize("a,b,equal", [
    ({"x": 0.0}, {"x": -0.0}, False), ({"x": float("nan")}, {"x": float("nan")}, False),
    ({"x": 1}, {"x": True}, False), ({"x": [1, 2]}, {"x": (1, 2)}, False),
    ({"t": torch.zeros(2)}, {"t": -torch.zeros(2)}, False), ({"t": torch.ones(2)}, {"t": torch.ones(2)}, True),
    ({"t": torch.ones(2)}, {"t": torch.ones(2, dtype=torch.float64)}, False), ({"a": 1, "b": 2}, {"b": 2, "a": 1}, False),
])
def test_same_is_bit_for_bit(a, b, equal):
    assert rollback.same(a, b) is equal


def test_a_snapshot_does_not_follow_the_original():
    state = {"list": [1, torch.zeros(2)], "t": torch.zeros(2)}
    copy = rollback.snapshot(state)
    state["list"].append(3)
    state["list"][1].add_(1)
    state["t"].add_(1)
    assert copy["list"][0] == 1 and len(copy["list"]) == 2 and copy["t"].sum() == 0 and copy["list"][1].sum() == 0
    with pytest.raises(Exception, match="object.*not supported"):
        rollback.snapshot({"bad": object()})


def test_the_stream_reader_reuses_an_unmoved_stream_and_sees_every_move():
    import numpy as np

    from unbroken.worker import rng
    from unbroken.worker.rng import StreamReader
    reader = StreamReader()
    first = reader.capture()
    assert reader.capture()["python"] is first["python"] and reader.capture()["numpy"] is first["numpy"]
    for move in (random.random, lambda: random.gauss(0, 1), lambda: random.gauss(0, 1),
                 np.random.rand, np.random.randn, np.random.randn, lambda: np.random.seed(4)):
        before = reader.capture()
        move()
        now = reader.capture()
        fresh = StreamReader().capture()  # what a full read says
        for name in ("python", "numpy"):
            assert rollback.same(now[name], fresh[name]), (move, name)
        assert rng._python_state(now["python"]) == random.getstate(), move  # the view's form is exact
        assert rollback.same(rng.portable(now)["python"], rng.portable(fresh)["python"]), move
        assert not (rollback.same(now["python"], before["python"]) and rollback.same(now["numpy"], before["numpy"]))


def test_norm_statistics_are_per_rank_and_a_dropped_step_puts_them_back():
    """BatchNorm's running statistics move in every forward (with the rank's own batch): they
    travel with the per-rank state, and a rollback restores them exactly."""
    tracked = TrackedState()
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    tracked.add("model", model, HOOKS)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    capture = rollback.capture(0, *tracked.step_start())
    assert sorted(capture.per_rank_tree()["buffers"]["model"]) == [
        "1.num_batches_tracked", "1.running_mean", "1.running_var"]
    model(torch.randn(8, 3))  # the step's forward moves the statistics
    assert not torch.equal(model[1].running_mean, before["1.running_mean"])
    tracked.load_rollback(capture.local(), capture.per_rank_tree())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_modules_without_norm_statistics_add_nothing_to_the_per_rank_state():
    assert "buffers" not in _tracked().per_rank_tree()


@pytest.mark.parametrize("a,b,equal", [
    ({"x": 0.0}, {"x": -0.0}, False), ({"x": float("nan")}, {"x": float("nan")}, True),  # the same NaN bits
    ({"x": 1}, {"x": True}, False), ({"x": 1}, {"x": 1.0}, False), ({"x": [1, 2]}, {"x": (1, 2)}, False),
    ({"t": torch.zeros(2)}, {"t": -torch.zeros(2)}, False), ({"t": torch.ones(2)}, {"t": torch.ones(2)}, True),
    ({"t": torch.ones(2)}, {"t": torch.ones(2, dtype=torch.float64)}, False),
    ({"t": torch.ones(2)}, {"t": torch.ones(1, 2)}, False), ({"a": 1, "b": 2}, {"b": 2, "a": 1}, False),
])
def test_equal_encodings_are_equal_states_bit_for_bit(a, b, equal):
    """StepStates tells an unchanged per-rank state by its encoding: equal bytes must mean equal
    types, key order, float signs, tensor dtypes, shapes and bytes."""
    encoder = blob.TreeEncoder()
    assert (encoder.encode(a) == encoder.encode(b)) is equal


class LiveBuffer:
    """A per-rank object whose state_dict returns the tensor it keeps changing in place."""

    def __init__(self) -> None:
        self.buffer = torch.zeros(3)

    def state_dict(self) -> dict:
        return {"buffer": self.buffer}

    def load_state_dict(self, state: dict) -> None:
        self.buffer.copy_(state["buffer"])


def test_a_tensor_changed_in_place_is_seen_and_a_dropped_step_gets_it_back():
    tracked = TrackedState()
    live = LiveBuffer()
    tracked.add("live", live, HOOKS)
    tracked.frozen = True
    states = rollback.StepStates(rank=0)
    states.begin(0, *tracked.step_start())
    live.buffer.add_(1.0)  # the same tensor object, new values
    assert not states.after_compute(tracked.per_rank_tree()).same
    live.buffer.add_(1.0)
    states.begin(1, *tracked.step_start())
    assert not states.start_report.same
    live.buffer.add_(5.0)  # the step moves it; the step is dropped
    tracked.load_rollback(states.capture.local(), states.capture.per_rank_tree())
    assert live.buffer.tolist() == [2.0, 2.0, 2.0]


def test_a_value_checkpoints_cannot_hold_is_named_by_its_path():
    tracked = TrackedState()
    position = Position()
    tracked.add("data", position, HOOKS)
    states = rollback.StepStates(rank=0)
    states.begin(0, *tracked.step_start())
    position.state_dict = lambda: {"position": 1, "odd": object()}  # a later state gains a value of another kind
    with pytest.raises(Exception, match="objects/data/odd.*not supported"):
        states.after_compute(tracked.per_rank_tree())


def test_the_torch_stream_is_reused_unmoved_and_every_move_is_seen():
    """torch's CPU stream read through its view: the captured form is reused while the stream does
    not move, and every kind of move is seen, including a change of the cached normal samples only."""
    import struct

    from unbroken.worker import rng
    if rng._torch_words() is None:
        pytest.skip(f"no view of the CPU generator on torch {torch.__version__}: every read is a full read")

    def with_samples(float_sample, double_sample):
        """The current state with the cached normal samples set (None: none cached)."""
        raw = bytearray(torch.get_rng_state().numpy().tobytes())
        struct.pack_into("<f?", raw, 5048, float_sample or 0.0, float_sample is not None)
        struct.pack_into("<dddi", raw, 5016, 0.0, double_sample or 0.0, 0.0, double_sample is not None)
        return lambda: torch.set_rng_state(torch.frombuffer(raw, dtype=torch.uint8).clone())

    reader = rng.StreamReader()
    first = reader.capture()
    assert reader.capture()["torch"] is first["torch"]
    for move in (lambda: torch.rand(3), lambda: torch.randn(1, dtype=torch.float64), lambda: torch.manual_seed(4),
                 with_samples(1.5, None), with_samples(1.5, 2.5), with_samples(None, 2.5), with_samples(None, None)):
        before = reader.capture()
        move()
        now = reader.capture()
        assert torch.equal(rng.torch_state(now["torch"]), torch.get_rng_state()), move
        assert not torch.equal(rng.torch_state(now["torch"]), rng.torch_state(before["torch"])), move
    state = reader.capture()
    torch.rand(2)
    reader.put_back(state)  # moved: set back
    assert torch.equal(torch.get_rng_state(), rng.torch_state(state["torch"]))
    reader.put_back(reader.capture())  # not moved: nothing to set
    assert torch.equal(torch.get_rng_state(), rng.torch_state(state["torch"]))
    assert torch.equal(rng.capture()["torch"], torch.get_rng_state())  # checkpoints keep get_rng_state()'s form


def test_every_state_dict_buffer_travels_per_rank_and_rolls_back():
    """A buffer a forward moves (a running mean, a counter) is per-rank state like BatchNorm's
    statistics; a buffer outside the state_dict (persistent=False) is not state."""
    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("seen", torch.zeros(()))
            self.register_buffer("mask", torch.ones(3), persistent=False)

        def forward(self, x):
            self.seen += 1
            return x * self.mask

    tracked = TrackedState()
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), Counting())
    tracked.add("model", model, HOOKS)
    tracked.frozen = True
    states = rollback.StepStates(rank=0)
    states.begin(0, *tracked.step_start())
    assert sorted(states.capture.per_rank_tree()["buffers"]["model"]) == ["1.seen"]
    model(torch.ones(1, 3))  # the step moves it
    model[1].seen = model[1].seen + 5  # or gives the name another tensor
    tracked.load_rollback(states.capture.local(), states.capture.per_rank_tree())
    assert model[1].seen.item() == 0.0


def test_buffers_moved_after_the_update_stay_per_rank_state():
    """An AveragedModel(use_buffers=True) averages each rank's own BatchNorm statistics after opt.step():
    its buffers differ by rank, so they travel as each rank's own state, read at the next step's start
    (the controller refuses to resume a rank lost inside the update from its state after compute)."""
    from torch.optim.swa_utils import AveragedModel
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    ema = AveragedModel(model, use_buffers=True)
    tracked = TrackedState()
    tracked.add("model", model, HOOKS)
    tracked.add("ema", ema, HOOKS)
    tracked.frozen = True
    model(torch.ones(3, 2)).sum().backward()  # the forward moves the model's statistics
    ema.update_parameters(model)  # after opt.step(): the average and its count move
    buffers = tracked.per_rank_tree()["buffers"]
    assert sorted(buffers["ema"]) == ["module.1.num_batches_tracked", "module.1.running_mean",
                                      "module.1.running_var", "n_averaged"]
    assert buffers["ema"]["n_averaged"].item() == 1 and sorted(buffers["model"]) == [
        "1.num_batches_tracked", "1.running_mean", "1.running_var"]


def test_a_dropped_step_forgets_what_a_grad_scaler_unscaled():
    """GradScaler records which optimizers it unscaled since its last update(), outside its state_dict:
    a redo that kept the record would skip the unscale and step on scaled gradients."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    tracked = TrackedState()
    for name, obj in (("model", model), ("opt", opt), ("scaler", scaler)):
        tracked.add(name, obj, HOOKS)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(opt)  # scaler.step() does this first; the step is then dropped
    tracked.drop_grads()
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(opt)  # the redo unscales again (was: "unscale_() has already been called ...")
    assert model.weight.grad is not None


def test_the_norm_layers_are_found_once_the_objects_are_frozen(monkeypatch):
    tracked = TrackedState()
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    tracked.add("model", model, HOOKS)
    tracked.frozen = True  # job.steps() began
    assert "buffers" in tracked.per_rank_tree()
    monkeypatch.setattr(torch.nn.Module, "named_modules", lambda *a, **k: pytest.fail("walked the module tree again"))
    assert sorted(tracked.step_start()[1]["buffers"]["model"]) == [
        "1.num_batches_tracked", "1.running_mean", "1.running_var"]


def test_the_replicated_part_is_kept_encoded_and_a_device_tensor_keeps_a_snapshot():
    """The step start's replicated part is its encoding (C code) while it holds CPU values only;
    a tensor on another device (meta here: what a GPU tensor takes) is kept by a snapshot on its
    device, and the step starts after it are snapshots too."""
    tracked = _tracked()
    states = rollback.StepStates(rank=0)
    states.begin(0, *tracked.step_start())
    assert isinstance(states.capture.local_state, bytes)
    want = rollback.snapshot(tracked.rollback_tree())
    tracked.objects["sched"].step()
    assert rollback.same(states.capture.local(), want)
    tracked.objects["ema"] = torch.zeros(2, device="meta")
    tracked._kept_layout = None
    states.begin(1, *tracked.step_start())
    kept = states.capture.local()
    assert isinstance(states.capture.local_state, dict) and kept["ema"].device.type == "meta"
    tracked.objects["ema"] = torch.zeros(2)
    states.begin(2, *tracked.step_start())
    assert isinstance(states.capture.local_state, dict)  # decided once: snapshots from then on


def test_an_encoder_for_cpu_values_refuses_a_device_tensor_and_a_big_int():
    encoder = blob.TreeEncoder(cpu_only=True)
    with pytest.raises(CheckpointError, match="meta"):
        encoder.encode({"t": torch.zeros(1, device="meta")})
    with pytest.raises(CheckpointError, match="format 2"):
        encoder.encode({"n": 1 << 70})
    assert blob.decode_tree(encoder.encode({"t": torch.arange(3)}), "x")["t"].tolist() == [0, 1, 2]
