"""examples/train_3d.py with a SIGKILL armed inside the pipeline schedule, for the tests.

``--kill-in-schedule RANK:STEP:MICRO``: rank RANK kills itself with SIGKILL in the backward of
micro-batch MICRO of step STEP, mid-schedule (its peers are sending, receiving or waiting on it).
Once per job: a marker file in the run dir ($UNBROKEN_RUN_DIR) records that it fired, so the
replacement process, started with the same command line, redoes the step without dying.
Every other flag is train_3d.py's.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

import train_3d  # noqa: E402  (examples/ on the path first)


def arm(spec: str):
    rank, step, micro = (int(v) for v in spec.split(":"))

    def on_stage(stage, job) -> None:
        if job.rank != rank:
            return
        marker = Path(os.environ.get("UNBROKEN_RUN_DIR", ".")) / f"killed-in-schedule-rank{rank}"
        seen = {"step": -1, "backwards": 0}

        def hook(grad):
            if job.step_index != seen["step"]:
                seen.update(step=job.step_index, backwards=0)
            seen["backwards"] += 1  # one call per micro-batch's backward through this stage
            if job.step_index == step and seen["backwards"] == micro + 1 and not marker.exists():
                marker.write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
            return grad
        first = next(p for p in stage.h[0].parameters())  # its grad comes late in each micro-batch's backward
        first.register_hook(hook)
    return on_stage


def main() -> None:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--kill-in-schedule", default="", help="RANK:STEP:MICRO")
    own, rest = p.parse_known_args()
    train_3d.main(rest, on_stage=arm(own.kill_in_schedule) if own.kill_in_schedule else None)


if __name__ == "__main__":
    main()
