"""The default run's fixed sample and the slow set's default seed."""

from __future__ import annotations

#: The slow set's seed and size unless UNBROKEN_GEN_SEED / UNBROKEN_GEN_COUNT say otherwise.
DEFAULT_SEED = 32
DEFAULT_COUNT = 60

#: The default run: every wrapper once, fast combinations (2 ranks where the wrapper allows it),
#: both fault kinds, every moment. ``<combination>@<fault>``, as :class:`.driver.Case` parses it.
DEFAULT_CASES = [
    "manual/ln-dropout/cursor/per-rank/clip+sched@SIGKILL:mid:rank1:step3",
    "ddp-job-group/mlp/loader/one-seed/-@SIGKILL:mid:rank1:step4",  # rolled back across a rollover
    "manual/mlp/loader-counter/one-seed/-@SIGKILL:mid:rank1:step4",  # refused up front
    "ddp-new-group/mlp/cursor/one-seed/accum@SIGKILL:before-first-step:rank0",
    "sharded/mlp/step/per-rank/clip@SIGKILL:last-step:rank3",
    "ddp/bn/step/one-seed/sched@SIGKILL:mid:rank2:step4",
    "fsdp/mlp/step/one-seed/-@SIGSTOP:mid:rank1:step3",
    "tp/ln-dropout/step/one-seed/sched@SIGKILL:mid:rank2:step3",
    "pp/mlp/cursor/per-rank/-@SIGKILL:after-loop:rank3",
    "manual/running/cursor/per-rank/-@SIGKILL:mid:rank1:step3",  # buffers its forward moves, per rank
]
