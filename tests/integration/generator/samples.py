"""The default run's fixed sample and the slow set's default seed."""

from __future__ import annotations

#: The slow set's seed and size unless UNBROKEN_GEN_SEED / UNBROKEN_GEN_COUNT say otherwise.
DEFAULT_SEED = 32
DEFAULT_COUNT = 60

#: The default run: every wrapper once, fast combinations (2 ranks where the wrapper allows it),
#: both fault kinds, every moment. ``<combination>@<fault>``, as :class:`.driver.Case` parses it.
DEFAULT_CASES = [
    "manual/mlp/step/one-seed/-@SIGKILL:mid:rank1:step3",
]
