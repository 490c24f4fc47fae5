"""Node loss under stock DistributedDataParallel, across real network namespaces (tests/netns/hosts.py).

tests/netns/test_node_faults.py with examples/train_ddp.py instead of train_gpt.py: DDP on the
default group, AdamW, LambdaLR, gradient accumulation with ``no_sync()``. Two nodes of 2 ranks each
(node 0 hosts the controller), a standby agent on a third host; node 1 is killed (SIGKILL of every
process) or frozen (SIGSTOP of every process) after step 4. Rung `recover` moves ranks 2 and 3 to the
standby, and the job ends with exit 0 and the final weights of a fault-free 4-rank single-node run
of the same script, bit for bit.
"""

from __future__ import annotations

import pytest

from tests.conftest import REPO, run_cli
from tests.integration.helpers import TRAIN_ARGS
from tests.netns.test_node_faults import SLOW, STEPS, run_with_fault, check_frozen, check_killed

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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_node_killed_its_ranks_move_to_the_standby_bit_exact(netns_hosts, tmp_path, reference):
    check_killed(*run_with_fault(netns_hosts, tmp_path, "kill", script=DDP_EXAMPLE, train_args=DDP_ARGS),
                 reference)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_node_frozen_is_lost_by_silence_its_ranks_move_to_the_standby_bit_exact(netns_hosts, tmp_path,
                                                                                     reference):
    check_frozen(*run_with_fault(netns_hosts, tmp_path, "freeze", script=DDP_EXAMPLE, train_args=DDP_ARGS),
                 reference)
