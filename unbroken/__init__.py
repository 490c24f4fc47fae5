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
from unbroken.worker.session import Job, init

__all__ = ["EXIT_FATAL", "FatalError", "Job", "UnbrokenError", "errors", "init", "optim"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # `unbroken.optim` is imported on first use: a script that does not use it pays nothing.
    if name == "optim":
        import importlib

        return importlib.import_module("unbroken.optim")
    raise AttributeError(f"module 'unbroken' has no attribute {name!r}")
