"""unbroken: keeps distributed PyTorch training running through failures.

The training-loop API::

    job = unbroken.init()
    job.track(model=model, optimizer=opt, scheduler=sched)
    for step in job.steps(total):
        with job.step():
            ...
"""

from unbroken import errors
from unbroken.errors import EXIT_FATAL, FatalError, UnbrokenError

__all__ = ["EXIT_FATAL", "FatalError", "Job", "UnbrokenError", "errors", "init", "optim"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported on first use: the launcher, the agent and the controller (which import
    # `unbroken.cli`, `.agent`, `.controller`) never import torch; a script that does not use
    # `unbroken.optim` pays nothing for it.
    import importlib

    if name == "Job":
        return importlib.import_module("unbroken.worker.session").Job
    if name == "init":
        return importlib.import_module("unbroken.worker.entry").init
    if name == "optim":
        return importlib.import_module("unbroken.optim")
    raise AttributeError(f"module 'unbroken' has no attribute {name!r}")
