"""This node's spare process, the agent's side: when one starts, what it is told, who takes it.

A node keeps at most one spare while in-flight recovery with a replacement is allowed
(``REPLACING_RUNGS``), and no warm one while the node's zygote can fork replacements (agent/forks.py): a *warm* spare (agent/spare.py: torch imported, then the modules the
script imported, told in JSON lines on its stdin) or, with ``--prerun-spares``, a *pre-run* spare
(agent/prerun.py: the script run up to its first rank-dependent read). A replacement of a lost
rank takes the pre-run spare if it can, else the warm one, else starts cold. After one is taken,
the next starts ``SPARE_RESTART_DELAY_S`` later. A pre-run spare that fails (or ran another job's
script) turns this node to warm spares for the rest of the job.

:class:`Spares` is owned by the agent's command thread (every method runs there: PR_SET_PDEATHSIG
follows the thread that forked, and that one lives as long as the agent). States: none ->
warm | pre-run (:meth:`Spares.start`) -> taken (:meth:`Spares.take_prerun`,
:meth:`Spares.take_warm`) -> none, due again after the delay; any -> none (:meth:`Spares.drop`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from unbroken.agent import prerun
from unbroken.agent.processes import die_with_parent, signal_group
from unbroken.config import LaunchConfig
from unbroken.names import REPLACING_RUNGS
from unbroken.protocol import messages as m

#: After a spare became a replacement, the next one starts this much later: its imports (seconds of
#: CPU) would otherwise compete with the recovery in progress (the replacement's script, the transfer).
SPARE_RESTART_DELAY_S = 3.0


class Spares:
    """The node's one spare (see the module docstring).

    ``base_env``: the worker environment a pre-run spare starts from (rank 0's of attempt 0), or None
    while this node has no job to run yet (a standby agent before its first order). ``send``: a
    message to the controller (the pre-run spare's events)."""

    def __init__(self, cfg: LaunchConfig, base_env: Callable[[], dict[str, str] | None],
                 send: Callable[[m.Message], bool], zygote_ready: Callable[[], bool] = lambda: False) -> None:
        self._cfg = cfg
        self._base_env = base_env
        self._send = send
        self._zygote_ready = zygote_ready  # the node's zygote forks replacements: no warm spare needed
        self._enabled = bool(REPLACING_RUNGS & set(cfg.recovery.allowed))
        self._prerun_allowed = cfg.prerun_spares  # False after a pre-run spare failed: warm ones from then on
        self._warm: subprocess.Popen | None = None
        self._prerun: prerun.PrerunSpare | None = None
        self._imports: list[str] = []  # what the script imported: each warm spare imports it too
        self._due_t: float | None = None  # when the next spare starts (after one was taken)

    @property
    def kind(self) -> str:
        """What the node holds now: ``warm``, ``prerun`` or ``none``."""
        return "prerun" if self._prerun is not None else "warm" if self._warm is not None else "none"

    @property
    def prerun_allowed(self) -> bool:
        """Whether the next spare may be a pre-run one (``--prerun-spares``, and none failed yet)."""
        return self._prerun_allowed

    # -- starting ----------------------------------------------------------------------------
    def start(self) -> None:
        """Pre-start a spare (none while one is there, or when no rung replaces a rank)."""
        if not self._enabled or self._warm is not None or self._prerun is not None:
            return
        env = self._base_env() if self._prerun_allowed else None
        if env is not None:  # (a standby agent's first spare, before it knows the job: warm)
            self._prerun = prerun.PrerunSpare.start(dict(os.environ), env, self._argv(), die_with_parent)
            return
        if self._zygote_ready():  # it imported torch once and forks a replacement in milliseconds (agent/forks.py)
            return
        env = dict(os.environ, OMP_NUM_THREADS=str(self._cfg.omp_num_threads), PYTHONUNBUFFERED="1")
        # -P: the working directory is not put on sys.path, so a folder named `unbroken` there
        # cannot shadow the installed package; the spare then sets sys.path[0] to the script's
        # folder, as `python script.py` does for a worker started without it.
        self._warm = subprocess.Popen([sys.executable, "-u", "-P", "-m", "unbroken.agent.spare"], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      start_new_session=True, preexec_fn=die_with_parent)
        if self._imports:
            self._tell({"imports": self._imports})

    def wait_s(self) -> float | None:
        """How long the command loop may wait for a message before the next spare is due or the
        pre-run spare is to be looked at (None: neither)."""
        due_s = None if self._due_t is None else max(0.0, self._due_t - time.monotonic())
        if self._prerun is not None:
            return prerun.POLL_S if due_s is None else min(due_s, prerun.POLL_S)
        return due_s

    def tick(self) -> None:
        """The command loop had no message for :meth:`wait_s`: start the spare that is due, and look
        at the pre-run one."""
        if self._due_t is not None and time.monotonic() >= self._due_t:
            self._due_t = None
            self.start()
        self._check_prerun()

    def set_imports(self, modules: list[str]) -> None:
        """The modules the script imported (the controller's SpareImports): the idle warm spare imports
        them now (a line on its stdin, read once its own imports are done), every later one at start."""
        self._imports = m.spare_import_names(modules)
        if self._warm is not None and self._imports and not self._tell({"imports": self._imports}):
            self.start()  # that one could not take the line (it died): a new one gets it at start

    # -- taking ------------------------------------------------------------------------------
    def take_prerun(self, env: dict[str, str], argv: list[str],
                    sink: Callable[[str], None]) -> tuple[subprocess.Popen, threading.Thread | None] | None:
        """The pre-run spare's process and output reader, now the replacement running ``argv`` with
        ``env`` (its output lines go to ``sink``), if it can take the order (prerun.take_decision);
        else None (and a spare that cannot take one is dropped)."""
        self._check_prerun()
        spare = self._prerun
        decision = spare.take(env, argv, sink) if spare is not None else "cold"
        if decision == "cold":
            return None
        if spare.failure is not None:
            self._send(m.AgentEvent(name="prerun_failed", fields=spare.failure))
        self._release_prerun()  # taken or dropped: the next one starts later
        self._due_t = time.monotonic() + SPARE_RESTART_DELAY_S
        return (spare.popen, spare.reader) if decision == "use" else None

    def take_warm(self, env: dict[str, str], argv: list[str]) -> subprocess.Popen | None:
        """The warm spare, told to run ``argv`` with ``env``; None when there is none alive."""
        spare = self._warm
        if spare is None or spare.poll() is not None:
            self._warm = None
            return None
        if not self._tell({"env": env, "argv": argv}):
            return None
        self._warm = None
        try:
            assert spare.stdin is not None
            spare.stdin.close()
        except OSError:
            pass
        self._due_t = time.monotonic() + SPARE_RESTART_DELAY_S
        return spare

    def drop(self) -> None:
        """Kill the spare (the job is over on this node)."""
        self._release_prerun()
        spare, self._warm = self._warm, None
        if spare is not None:
            signal_group(spare, signal.SIGKILL)
            spare.wait()

    # -- helpers -----------------------------------------------------------------------------
    def _argv(self) -> list[str]:
        return [self._cfg.script, *self._cfg.script_args]

    def _tell(self, line: dict) -> bool:
        """One JSON line to the idle warm spare's stdin (it reads them in order: agent/spare.py); a
        spare that cannot take it is dropped (the next replacement then starts cold or from a new one)."""
        spare = self._warm
        try:
            assert spare is not None and spare.stdin is not None
            spare.stdin.write((json.dumps(line) + "\n").encode())
            spare.stdin.flush()
            return True
        except OSError:
            self.drop()
            return False

    def _check_prerun(self) -> None:
        """Report the pre-run spare ready, or exited (-> warm spares from now on)."""
        spare = self._prerun
        for name, fields in spare.poll() if spare is not None else ():
            self._send(m.AgentEvent(name=name, fields=fields))
        if spare is not None and spare.state == "exited":
            self._release_prerun()
            self.start()

    def _release_prerun(self) -> None:
        """Let the pre-run spare go (taken: a worker now); one not taken is dropped, warm spares from now on."""
        spare, self._prerun = self._prerun, None
        if spare is not None and spare.state != "taken":
            self._prerun_allowed = False
            spare.drop()
