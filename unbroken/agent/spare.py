"""A warm spare: a Python process that has already imported torch, waiting to become a worker.

Importing torch costs about a second (FACTS.md), most of the time a replacement process
needs before it can join the next generation; the first ``torch.optim`` optimizer or
``DistributedDataParallel`` a script builds imports ``torch._dynamo``, 1-5 s more on a loaded
machine, so the spare imports that too. The agent keeps one spare per node when
in-flight recovery is allowed; to replace a lost rank it sends the spare one JSON line on
stdin: the worker's environment and command line. The spare then sets them and runs the
training script as ``__main__``, exactly as ``python -u script.py args...`` would.

Started with the environment that matters at torch's import (``OMP_NUM_THREADS``) already
set, so a replacement runs with the thread settings of the process it replaces.
"""

from __future__ import annotations

import json
import os
import runpy
import sys


def main() -> None:
    import torch  # noqa: F401  - the point of a warm spare
    import torch._dynamo  # noqa: F401  - the first optimizer or DDP built imports it: 1-5 s otherwise
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    import unbroken.worker.session  # noqa: F401  - what unbroken.init() imports

    line = sys.stdin.readline()
    if not line:  # the agent closed our stdin: not needed any more
        return
    order = json.loads(line)
    os.environ.update({str(k): str(v) for k, v in order["env"].items()})
    argv = [str(a) for a in order["argv"]]
    script = os.path.abspath(argv[0])
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(script))  # as `python script.py` sets sys.path[0]
    sys.stdin.close()
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
