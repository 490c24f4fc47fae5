"""The unassigned Job of a pre-run spare (worker/prerun.py): what it knows at once, where it
blocks, what it replays at assignment. One process, no job: the order comes from a fake."""

from __future__ import annotations

import io
import json
import os
import sys
import threading

import pytest
import torch

from unbroken.worker.prerun import AT_STEPS, PrerunJob, StdioOrders
from unbroken.worker_config import prerun_from_env

ORDER = {"env": {"RANK": "3"}, "argv": ["train.py"]}


class FakeOrders:
    """The agent's side: records ``ready``, hands out the order once the test releases it."""

    def __init__(self) -> None:
        self.where: list[str] = []
        self.release = threading.Event()

    def ready(self, where: str) -> None:
        self.where.append(where)

    def wait(self) -> dict:
        assert self.release.wait(10), "the test never released the order"
        return ORDER


class FakeJob:
    def __init__(self, order: dict) -> None:
        self.rank, self.order, self.tracked = int(order["env"]["RANK"]), order, []
        self.process_group, self.all_reduce = "group", lambda tensor: tensor

    def track(self, *, per_rank=(), replicated=(), **objects) -> None:
        self.tracked.append((objects, tuple(per_rank), tuple(replicated)))

    def steps(self, total: int):
        return iter(range(total))


def _prerun(orders: FakeOrders, built: list) -> PrerunJob:
    def build(order):
        built.append(FakeJob(order))
        return built[-1]
    return PrerunJob(world_size=4, device=None, orders=orders, build=build)


@pytest.mark.timeout(20)
def test_world_size_device_and_track_need_no_rank():
    orders, built = FakeOrders(), []
    job = _prerun(orders, built)
    model = torch.nn.Linear(2, 2)
    job.track(model=model, per_rank=["sampler"])
    assert (job.world_size, job.device, job.assigned) == (4, torch.device("cpu"), False)
    assert not orders.where and not built  # nothing asked for the rank yet


@pytest.mark.timeout(20)
@pytest.mark.parametrize("read,where", [
    (lambda job: job.rank, "job.rank"),
    (lambda job: job.process_group, "job.process_group"),
    (lambda job: job.all_reduce(torch.ones(1)), "job.all_reduce"),
    (lambda job: list(job.steps(2)), AT_STEPS),
], ids=["rank", "process_group", "all_reduce", "steps"])
def test_the_first_rank_dependent_read_blocks_until_the_order(read, where):
    orders, built = FakeOrders(), []
    job = _prerun(orders, built)
    model = torch.nn.Linear(2, 2)
    job.track(model=model, per_rank=["sampler"])
    got: list = []
    reader = threading.Thread(target=lambda: got.append(read(job)))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive() and not got, "the read did not wait for the order"
    assert orders.where == [where] and job.blocked_at == where
    orders.release.set()
    reader.join(10)
    assert not reader.is_alive() and job.assigned
    (real,) = built
    assert real.tracked == [({"model": model}, ("sampler",), ())]  # replayed on the real session
    if where == "job.rank":
        assert got == [3]
    job.track(optimizer="x")  # after assignment: straight to the real session
    assert real.tracked[-1] == ({"optimizer": "x"}, (), ())
    assert job.rank == 3 and orders.where == [where]  # asked once


@pytest.mark.timeout(20)
def test_stdio_orders_report_ready_on_the_fd_and_skip_other_lines(monkeypatch):
    read_fd, write_fd = os.pipe()
    lines = [json.dumps({"imports": ["numpy"]}), json.dumps(ORDER)]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(("\n".join(lines) + "\n").encode())))
    orders = StdioOrders(write_fd)
    orders.ready("job.rank")
    orders.ready("job.rank")  # once only: the fd is closed after the first
    assert json.loads(os.read(read_fd, 4096)) == {"where": "job.rank", "pid": os.getpid()}
    assert os.read(read_fd, 4096) == b""  # closed
    os.close(read_fd)
    assert orders.wait() == ORDER


@pytest.mark.timeout(20)
def test_stdio_orders_end_the_spare_quietly_when_the_agent_closes_stdin(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    with pytest.raises(SystemExit) as exited:
        StdioOrders(-1).wait()
    assert exited.value.code == 0


def test_prerun_from_env_reads_the_fd_and_the_world_size():
    assert prerun_from_env({"WORLD_SIZE": "4"}) is None
    assert prerun_from_env({"UNBROKEN_PRERUN": "7", "WORLD_SIZE": "4"}) == (7, 4)


def test_the_unassigned_job_is_a_job_that_overrides_every_public_member():
    """No proxy: init() returns a Job; each public member of Job (its methods and properties, and the
    attributes its constructor sets) is PrerunJob's own, so none reads a Job field never set."""
    import inspect

    from unbroken.worker.session import Job

    assert issubclass(PrerunJob, Job)
    set_in_init = {n for n in ("cfg", "rank", "world_size", "local_rank", "attempt", "device")
                   if f"self.{n}" in inspect.getsource(Job.__init__)}
    public = {n for n in vars(Job) if not n.startswith("_")} | set_in_init
    job = PrerunJob(world_size=2, device=None, orders=FakeOrders(), build=lambda order: None)
    missed = {n for n in public if n not in vars(PrerunJob) and n not in vars(job)}
    assert not missed, f"PrerunJob must override: {sorted(missed)}"


def test_init_returns_the_unassigned_job_in_a_prerun_spare(monkeypatch):
    import unbroken

    monkeypatch.setenv("UNBROKEN_PRERUN", "-1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    job = unbroken.init(pg_timeout_s=5.0)
    assert isinstance(job, PrerunJob) and job.world_size == 8 and not job.assigned
