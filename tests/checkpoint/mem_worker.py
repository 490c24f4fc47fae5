"""Test helper: a worker that writes shared-memory snapshots in a loop until it is killed.

    python mem_worker.py SHM_DIR JOB_ID RANK SIZE_MB

Snapshot contents are a function of the step (see `expected_state`), so the test can check
bit for bit whatever snapshot survives a SIGKILL. Steps continue after the newest committed
one, so a restarted worker resumes the sequence.
"""

import sys

import torch

from unbroken.checkpoint.memory import SnapshotWriter

N_BIG = 4


def expected_state(step: int, size_mb: int, big: list | None = None) -> dict:
    """The state written at `step` (fills `big` in place when given, to avoid reallocating)."""
    numel = size_mb * (1 << 20) // 4 // N_BIG
    big = big if big is not None else [torch.empty(numel) for _ in range(N_BIG)]
    for i, t in enumerate(big):
        t.fill_(float(step * 10 + i))
    small = torch.randn(1000, generator=torch.Generator().manual_seed(step))
    return {"big": big, "small": small, "step": step, "tag": f"step-{step}"}


def main() -> None:
    shm_dir, job_id, rank, size_mb = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    writer = SnapshotWriter(shm_dir, job_id, rank)
    step = (writer.committed_step or 0) + 1
    big = None
    while True:
        state = expected_state(step, size_mb, big)
        big = state["big"]
        writer.write(step, state, meta={"step": step})
        writer.flush()
        step += 1


if __name__ == "__main__":
    main()
