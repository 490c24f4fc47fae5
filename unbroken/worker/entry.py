"""``unbroken.init()``: the session of this process, a :class:`~unbroken.worker.session.Job`.

A rank's own Job (worker/session.py) or, in a pre-run spare, a Job that waits for its rank
(worker/prerun.py). Its own module so that the pre-run Job can build on the session without a
circle of imports.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from unbroken.errors import FatalError
from unbroken.worker.prerun import unassigned_job
from unbroken.worker.session import Job, exit_fatal
from unbroken.worker_config import managed_from_env, prerun_from_env, worker_config_from_env


def init(**overrides: Any) -> Job:
    """Join the job this process belongs to and return its session.

    Works under `unbroken run`, under plain `torchrun`, and in a plain ``python`` process (world size 1).
    Keyword arguments override the environment: ``save_dir``, ``load_dir``, ``every_steps``, ``keep``,
    ``run_dir``, ``inject``, and every field of :class:`unbroken.worker_config.WorkerSettings` (``pg_timeout_s``,
    ...); ``device`` and ``backend`` choose the device and the process-group backend. In a pre-run spare
    (``--prerun-spares``) the session is unassigned until the agent gives it a rank (worker/prerun.py).

    Under `unbroken run`, a FatalError here (e.g. a ConfigError) and in ``job.track()``, ``job.steps()`` or
    a ``with job.step():`` block is logged at ERROR and ends the process with :data:`unbroken.EXIT_FATAL`:
    the job fails at once instead of restarting. Elsewhere it propagates as raised.
    """
    device, backend = overrides.pop("device", None), overrides.pop("backend", None)
    if (prerun := prerun_from_env()) is not None:
        return unassigned_job(prerun, device, functools.partial(_join, overrides, device, backend))
    return _join(overrides, device, backend)


def _join(overrides: dict[str, Any], device: torch.device | None, backend: str | None) -> Job:
    try:
        return Job(worker_config_from_env(**overrides), device=device, backend=backend)
    except FatalError as exc:
        if managed_from_env():
            exit_fatal(exc, "worker")
        raise
