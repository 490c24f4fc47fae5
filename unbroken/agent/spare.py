"""A warm spare: a Python process that has already imported torch, waiting to become a worker.

Importing torch costs about a second (FACTS.md), most of the time a replacement process
needs before it can join the next generation; the first ``torch.optim`` optimizer or
``DistributedDataParallel`` a script builds imports ``torch._dynamo``, 1-5 s more on a loaded
machine, so the spare imports that too. The agent keeps one spare per node when
in-flight recovery is allowed and talks to it in JSON lines on its stdin, read in order once
those imports are done:

* ``{"imports": [name, ...]}``: the modules the job's script imported (one worker reported
  them at ``unbroken.init()``: worker/script_imports.py); the spare imports each, so the
  replacement running the script finds them imported. An import that fails is logged and
  skipped, never fatal;
* ``{"env": {...}, "argv": [...]}``: replace a lost rank. The spare sets the worker's
  environment and command line and runs the training script as ``__main__``, exactly as
  ``python -u script.py args...`` would.

After its imports the spare runs one tiny forward, backward and optimizer step (:func:`warm_up`).
A *pre-run* spare (``--prerun ARGV...``, agent/prerun.py) then runs the script at once, with the
worker environment minus the rank; its session blocks at the first rank-dependent read and reads
its order from stdin itself (worker/prerun.py); it gets no ``imports`` lines.
Started with the environment that matters at torch's import (``OMP_NUM_THREADS``) already
set, so a replacement runs with the thread settings of the process it replaces.
"""

from __future__ import annotations

import gc
import importlib
import json
import logging
import os
import runpy
import sys

log = logging.getLogger(__name__)


def main() -> None:
    import torch  # noqa: F401  - the point of a warm spare
    import torch._dynamo  # noqa: F401  - the first optimizer or DDP built imports it: 1-5 s otherwise
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    import unbroken.worker.entry  # noqa: F401  - what unbroken.init() imports
    from unbroken.protocol.messages import spare_import_names

    warm_up()
    gc.freeze()  # as the zygote does (agent/zygote.py load): the collector skips what the imports made
    if sys.argv[1:2] == ["--prerun"]:
        run_as_main(sys.argv[2:])
        return
    for line in sys.stdin:
        order = json.loads(line)
        if "imports" in order:
            pre_import(spare_import_names(order["imports"]))
            continue
        run_script(order)
        return
    # the agent closed our stdin without an order: not needed any more


def warm_up() -> None:
    """Run once what every training step runs (module init, forward, backward, an AdamW step), so
    the first calls' set-up (tens of ms, more under load) is not paid by the replacement's first,
    redone, step while every survivor waits in its all-reduce. On tiny CPU tensors, the global RNG
    put back after; nothing of it stays but the warmed code paths."""
    import torch
    import torch.nn.functional as F

    try:
        with torch.random.fork_rng(devices=[]):
            emb, norm, lin = torch.nn.Embedding(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8)
            opt = torch.optim.AdamW([*emb.parameters(), *norm.parameters(), *lin.parameters()])
            q = lin(norm(emb(torch.tensor([[0, 1]])))).view(1, 1, 2, 8)
            out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
            F.cross_entropy(F.gelu(out).view(-1, 4, 2).sum(-1), torch.tensor([0, 1])).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    except Exception as exc:  # noqa: BLE001 - a warm-up that fails costs only its time later
        log.warning("unbroken spare (pid %d): warm-up failed: %s: %s", os.getpid(), type(exc).__name__, exc)


def pre_import(names: list[str]) -> int:
    """Import each of ``names`` not imported yet; return how many failed (each one logged)."""
    failed = 0
    for name in names:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - any failure (even SystemExit) only costs its import later
            failed += 1
            log.warning("unbroken spare (pid %d): could not pre-import %s: %s: %s", os.getpid(), name,
                        type(exc).__name__, exc)
    return failed


def run_script(order: dict) -> None:
    os.environ.update({str(k): str(v) for k, v in order["env"].items()})
    sys.stdin.close()
    run_as_main([str(a) for a in order["argv"]])


def run_as_main(argv: list[str]) -> None:
    script = os.path.abspath(argv[0])
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(script))  # as `python script.py` sets sys.path[0]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
