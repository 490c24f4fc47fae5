"""Which modules the training script imported, for the job's warm spares to import ahead.

A replacement process runs the script from its top; every module the script imports that the
warm spare (agent/spare.py) has not imported yet costs its import time (seconds for a large
library on a loaded machine) inside the recovery. So one worker reports, once at
``unbroken.init()``, the modules its process has imported by then, and the agents' spares import
them too (protocol message ``SpareImports``).

What is reported (:func:`script_imports`, pure over a ``sys.modules``-like mapping):

* top-level modules and packages, and packages up to ``MAX_DEPTH`` dotted parts below a top level
  (``torch.distributed.fsdp``: a subpackage can cost more than its parent);
* not ``__main__`` and no name with a private part (``_`` first: imported by their public parents);
* not the standard library (cheap, and what torch needs of it the spare has anyway);
* not a module of the script's own directory unless that directory is also on the path beyond
  ``sys.path[0]`` (a spare's path lacks the script's folder until it runs the script, and importing
  the user's own modules early could run their side effects too soon);
* at most ``MAX_SPARE_IMPORTS`` names, top levels first.

Runs in the training thread of one worker, once.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from types import ModuleType

from unbroken.names import SCRIPT_IMPORTS_EVENT
from unbroken.protocol.messages import MAX_SPARE_IMPORTS, spare_import_names
from unbroken.worker.control import ControlClient
from unbroken.worker_config import WorkerConfig

MAX_DEPTH = 3  # dotted parts of a subpackage reported (torch.distributed.fsdp)
_NOT_SCRIPT = frozenset({"__main__", "__mp_main__"})


def script_imports(modules: Mapping[str, ModuleType], *, script_dir: str | None,
                   path: Sequence[str] = ()) -> list[str]:
    """The module names of ``modules`` a spare should import (see the module docstring).

    ``script_dir``: the script's directory (its modules are left out unless that directory is
    also in ``path``, the import path beyond the script's own entry)."""
    own_dir = _real(script_dir) if script_dir else None
    if own_dir is not None and own_dir in {_real(p) for p in path if p}:
        own_dir = None  # importable by name from another path entry: a spare finds them too
    top, sub = [], []
    for name, module in list(modules.items()):
        parts = name.split(".")
        if (name in _NOT_SCRIPT or any(p.startswith("_") for p in parts) or len(parts) > MAX_DEPTH
                or parts[0] in sys.stdlib_module_names or parts[0] in sys.builtin_module_names):
            continue
        if len(parts) > 1 and _attr(module, "__path__") is None:
            continue  # below a top level, packages only
        if own_dir is not None and _under(module, own_dir):
            continue
        (top if len(parts) == 1 else sub).append(name)
    ordered = sorted(top) + sorted(sub, key=lambda n: (n.count("."), n))
    return spare_import_names(ordered[:MAX_SPARE_IMPORTS])


def report(control: ControlClient | None, cfg: WorkerConfig) -> None:
    """Rank 0 of a launch (not a replacement), under `unbroken run`: tell the controller what this
    process imported (:func:`current`), unless ``--no-spare-preimport``."""
    if control is not None and cfg.rank == 0 and not cfg.replacement and cfg.worker.spare_preimport:
        control.event(SCRIPT_IMPORTS_EVENT, {"modules": current()})


def current() -> list[str]:
    """:func:`script_imports` of this process (the script: ``sys.argv[0]``)."""
    script = sys.argv[0] if sys.argv and sys.argv[0] else ""
    script_dir = os.path.dirname(os.path.abspath(script)) if os.path.isfile(script) else None
    return script_imports(sys.modules, script_dir=script_dir, path=sys.path[1:])


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(path))


def _attr(module: object, name: str) -> object:
    """A module's own attribute, read from its ``__dict__``: never a lazy module's ``__getattr__``."""
    return getattr(module, "__dict__", {}).get(name)


def _under(module: ModuleType, directory: str) -> bool:
    """True if ``module``'s file, or any of its package's folders, lies in ``directory``."""
    try:
        places = [_attr(module, "__file__") or ""] + [str(p) for p in (_attr(module, "__path__") or [])]
    except TypeError:  # an odd __path__: not ours to judge, leave the module out
        return True
    prefix = directory.rstrip(os.sep) + os.sep
    return any(isinstance(p, str) and p and _real(p).startswith(prefix) for p in places)
