"""Node loss under stock DistributedDataParallel, across real network namespaces (tests/netns/hosts.py).

tests/netns/test_node_faults.py with examples/train_ddp.py instead of train_gpt.py: DDP on the
default group, AdamW, LambdaLR, gradient accumulation with ``no_sync()``. Two nodes of 2 ranks each
(node 0 hosts the controller), a standby agent on a third host; node 1 is killed (SIGKILL of every
process) or frozen (SIGSTOP of every process) after step 4. Rung `recover` moves ranks 2 and 3 to the
standby, and the job ends with exit 0 and the final weights of a fault-free 4-rank single-node run
of the same script, bit for bit.
"""

from __future__ import annotations

import time

import pytest

from tests.conftest import REPO, run_cli
from tests.integration.helpers import TRAIN_ARGS, events
from tests.netns.job import NetnsJob
from tests.netns.test_node_faults import FLAGS, NODE_TIMEOUT_S, SLOW, STEPS, _alive, _check_recovered

DDP_EXAMPLE = REPO / "examples" / "train_ddp.py"
# The script's arguments after --steps/--out/TRAIN_ARGS, the same in the reference and the netns job.
DDP_ARGS = ["--grad-accum", "2", *SLOW]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The final weights of a fault-free 4-rank single-node `unbroken run` of train_ddp.py."""
    tmp = tmp_path_factory.mktemp("ddp-netns-reference")
    out = tmp / "reference.safetensors"
    result = run_cli(["run", "--nproc-per-node", "4", "--run-dir", str(tmp / "run-reference"), str(DDP_EXAMPLE),
                      "--steps", str(STEPS), "--out", str(out), *TRAIN_ARGS, *DDP_ARGS], timeout_s=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def _run_with_fault(netns_hosts, tmp_path, fault: str) -> tuple[NetnsJob, list[int]]:
    """Start the DDP job with a standby, hit node 1 with ``fault`` after rank 0's step 4; (job, node
    1's worker pids). Returns once those are gone, or after 60 s."""
    job = NetnsJob(netns_hosts(3), tmp_path, standby=True, steps=STEPS, flags=FLAGS, train_args=DDP_ARGS,
                   script=DDP_EXAMPLE)
    job.wait_step(0, 4, timeout_s=360)
    victims = [e["pid"] for e in events(job.run_dir, "rank_started") if e["rank"] in (2, 3)]
    assert len(victims) == 2, events(job.run_dir)  # (a restart before the fault would be a fault of its own)
    getattr(job.hosts[1], fault)()
    deadline = time.monotonic() + 60
    while _alive(victims) and time.monotonic() < deadline:
        time.sleep(0.05)
    return job, victims


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_node_killed_its_ranks_move_to_the_standby_bit_exact(netns_hosts, tmp_path, reference):
    job, victims = _run_with_fault(netns_hosts, tmp_path, "kill")
    assert not _alive(victims), "a killed node's workers are gone"
    _check_recovered(job, reference)
    # A dead node closes its connections: lost at once, not after the silence timeout.
    assert not events(job.run_dir, "agent_silent")
    assert [e["node_rank"] for e in events(job.run_dir, "agent_lost")] == [1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_node_frozen_is_lost_by_silence_its_ranks_move_to_the_standby_bit_exact(netns_hosts, tmp_path,
                                                                                     reference):
    job, victims = _run_with_fault(netns_hosts, tmp_path, "freeze")
    assert _alive(victims), "a frozen node's workers are stopped, not dead"
    job.wait_for(lambda: events(job.run_dir, "recovered_in_flight"), 180, "the recovery onto the standby")
    job.hosts[1].thaw()  # it wakes up after the job moved on without it: its agent and workers leave
    _check_recovered(job, reference)
    (silent,) = events(job.run_dir, "agent_silent")
    assert silent["node_rank"] == 1 and silent["silent_s"] >= NODE_TIMEOUT_S
    assert job.agents[1].wait(90) not in (0, None), job.outputs()
    assert not _alive(victims)
