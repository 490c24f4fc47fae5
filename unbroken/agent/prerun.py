"""A pre-run spare, the agent's side (``unbroken run --prerun-spares``).

A warm spare (agent/spare.py) has imported torch; a pre-run spare has also run the training
script up to its first rank-dependent read (worker/prerun.py): data, model and optimizer built,
so a replacement costs a regroup and a transfer only. The agent starts it with the job's argv and
the worker environment without the rank-dependent variables (:data:`RANK_KEYS`: a script reading
them raises in the spare instead of building the wrong state) and without those of one attempt
(:data:`ATTEMPT_KEYS`: they come with the order), plus ``UNBROKEN_PRERUN=<fd>``, the pipe it reports
ready on. Its output is read from the start (a full pipe would stop the script); lines before the
order are kept only as the tail for ``prerun_failed``.

States: ``starting`` (running its script) -> ``ready`` (blocked at ``where``; event ``spare_ready``)
-> ``taken`` (the order sent: the rank's worker now). ``exited`` (before an order; event
``prerun_failed`` with its exit code and last lines) and a take whose argv or environment differ
from the order's (the script ran for another job: ``prerun_failed`` too) make the agent use warm
spares for the rest of the job (:func:`take_decision`). Owned by the agent's command thread; one
reader thread per spare reads its output.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from unbroken.worker_config import ENV_DATA_RANKS, ENV_GEN, ENV_PRERUN, ENV_RESTORE_RANK, ENV_STORE_PREFIX

#: Rank-dependent: never in a pre-run spare's environment (a shrunk job's data ranks included: rung elastic).
RANK_KEYS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", ENV_DATA_RANKS, ENV_RESTORE_RANK)
#: One attempt's (or generation's): set by the order, not compared with it.
ATTEMPT_KEYS = ("TORCHELASTIC_RESTART_COUNT", ENV_GEN, ENV_STORE_PREFIX, "MASTER_ADDR", "MASTER_PORT")
#: How often the agent's command loop looks at a pre-run spare (ready? exited?).
POLL_S = 0.5
TAIL_LINES = 20


def prerun_env(worker_env: dict[str, str]) -> dict[str, str]:
    """The part of a worker's environment a pre-run spare gets (no rank, no attempt)."""
    return {k: v for k, v in worker_env.items() if k not in RANK_KEYS + ATTEMPT_KEYS}


def order_mismatch(given: dict[str, str], argv: list[str], order_env: dict[str, str], order_argv: list[str]) -> str:
    """Why a pre-run spare started with ``given`` (its worker environment) and ``argv`` cannot
    take this order ("" if it can): what it ran must be what the replacement would run."""
    if list(argv) != list(order_argv):
        return f"argv differs: the spare ran {argv!r}, the order runs {order_argv!r}"
    changed = sorted(k for k, v in given.items() if order_env.get(k) != v)
    return f"environment differs in {', '.join(changed)}" if changed else ""


def take_decision(state: str, mismatch: str) -> str:
    """What the agent does with its pre-run spare when a rank is lost here: ``use`` it (ready, same
    argv and environment); ``cold`` (still running its script: a fresh process replaces the rank,
    the spare stays for the next loss); ``fallback`` (it exited, or it ran something else: dropped,
    warm spares from now on)."""
    if state == "exited" or (state == "ready" and mismatch):
        return "fallback"
    return "use" if state == "ready" else "cold"


class PrerunSpare:
    """One pre-run spare process (module docstring): its state, ``where`` it blocked, its output's tail."""

    def __init__(self, popen: subprocess.Popen, ready_fd: int, given: dict[str, str], argv: list[str]) -> None:
        self.popen, self.given, self.argv = popen, given, list(argv)
        self.state, self.where = "starting", ""
        self.failure: dict[str, Any] | None = None  # prerun_failed's fields, after a take that fell back
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._ready_fd, self._ready_buf = ready_fd, b""
        self._started_t = time.monotonic()
        self._sink: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        self.reader = threading.Thread(target=self._read_output, name=f"unbroken-prerun-{popen.pid}", daemon=True)
        self.reader.start()

    @classmethod
    def start(cls, base_env: dict[str, str], worker_env: dict[str, str], argv: list[str],
              preexec_fn: Callable[[], None] | None = None) -> PrerunSpare:
        """Start one from the agent's command thread (PR_SET_PDEATHSIG follows the forking thread)."""
        given = prerun_env(worker_env)
        read_fd, write_fd = os.pipe()
        env = {k: v for k, v in {**base_env, **given}.items() if k not in RANK_KEYS}
        env[ENV_PRERUN] = str(write_fd)
        try:
            # -P: see Agent._start_spare; the spare puts the script's folder first on sys.path.
            popen = subprocess.Popen([sys.executable, "-u", "-P", "-m", "unbroken.agent.spare", "--prerun", *argv],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=preexec_fn, pass_fds=(write_fd,))
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        os.set_blocking(read_fd, False)
        return cls(popen, read_fd, given, argv)

    def poll(self) -> list[tuple[str, dict[str, Any]]]:
        """New events since the last call: ``spare_ready`` once it blocked, ``prerun_failed`` once it
        exited before an order."""
        out = []
        if self.state == "starting" and self._read_ready():
            out.append(("spare_ready", {"pid": self.popen.pid, "where": self.where,
                                        "ready_s": round(time.monotonic() - self._started_t, 3)}))
        if self.state in ("starting", "ready") and self.popen.poll() is not None:
            out.append(self._exited("exited before it was given a rank"))
        return out

    def take(self, env: dict[str, str], argv: list[str], sink: Callable[[str], None]) -> str:
        """Give it this rank's order (environment, argv) if it can take it (:func:`take_decision`);
        its output goes to ``sink`` from then on. On a ``fallback`` not reported by :meth:`poll`,
        :attr:`failure` holds the ``prerun_failed`` fields."""
        self.failure = None
        mismatch = order_mismatch(self.given, self.argv, env, argv) if self.state == "ready" else ""
        decision = take_decision(self.state, mismatch)
        if mismatch:
            self.failure = self._exited(mismatch)[1]
        if decision != "use":
            return decision
        with self._lock:
            self._sink = sink
        try:
            assert self.popen.stdin is not None
            self.popen.stdin.write((json.dumps({"env": env, "argv": list(argv)}) + "\n").encode())
            self.popen.stdin.close()
        except OSError:  # it died just now
            with self._lock:
                self._sink = None
            self.failure = self._exited("could not take its order")[1]
            return "fallback"
        self.state = "taken"
        return decision

    def drop(self) -> None:
        """Kill it (its whole process group) and reap it, unless taken (then it is a worker)."""
        self._close_ready()
        if self.state == "taken":
            return
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.popen.wait()
        self.state = "dropped" if self.state != "exited" else self.state

    def _exited(self, reason: str) -> tuple[str, dict[str, Any]]:
        code = self.popen.poll()
        if code is not None:
            self.reader.join(timeout=0.5)  # the last lines say why
        fields = {"pid": self.popen.pid, "reason": reason, "where": self.where,
                  "exit_code": code if code is not None and code >= 0 else None,
                  "signal": -code if code is not None and code < 0 else None, "last_lines": list(self.tail)}
        if code is not None:
            self.state = "exited"
        return "prerun_failed", fields

    def _read_ready(self) -> bool:
        try:
            self._ready_buf += os.read(self._ready_fd, 4096) if self._ready_fd >= 0 else b""
        except OSError:  # BlockingIOError: nothing yet
            return False
        line, sep, _ = self._ready_buf.partition(b"\n")
        if not sep:
            return False
        try:
            where = json.loads(line).get("where")
        except (ValueError, AttributeError):
            where = None
        self.where = where if isinstance(where, str) else "?"
        self.state = "ready"
        self._close_ready()
        return True

    def _close_ready(self) -> None:
        fd, self._ready_fd = self._ready_fd, -1
        if fd >= 0:
            os.close(fd)

    def _read_output(self) -> None:
        assert self.popen.stdout is not None
        for raw in iter(self.popen.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with self._lock:
                sink = self._sink
                if sink is None:
                    self.tail.append(line)
            if sink is not None:
                sink(line)
        self.popen.stdout.close()
