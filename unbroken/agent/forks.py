"""The node's zygote, the agent's side: ranks forked from a process that imported torch once.

:class:`Zygote` starts agent/zygote.py when the agent starts (so its imports overlap the
controller's start and the rendezvous) and asks it for ranks; each comes back as a
:class:`ForkedRank`, which the agent holds where it would hold a ``subprocess.Popen`` (pid,
stdout, poll, wait, returncode). The zygote is the ranks' parent: it reports their exits, which
a reader thread here collects. Whenever the zygote cannot fork (not ready in time, refused
because it is no longer single-threaded, gone), :meth:`Zygote.fork` returns None and the agent
starts the rank as before, ``python -u script``; it never fails a rank's start.

The agent waits for the zygote's imports (:meth:`Zygote.wait_ready`) before it joins the job.
Threads: :meth:`Zygote.start` in the agent's main thread (PR_SET_PDEATHSIG follows the thread
that forked, and that one lives as long as the agent), :meth:`Zygote.fork` in its command
thread, ``poll``/``wait`` from any; the reader thread owns the socket's receiving end.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO

from unbroken.agent import pool
from unbroken.agent.processes import die_with_parent
from unbroken.agent.zygote import build as zygote_build
from unbroken.worker_config import ENV_RUN_DIR

log = logging.getLogger(__name__)

#: How long the agent waits for the zygote's imports before it joins the job (~3-6 s of CPU, a
#: minute on a loaded machine); after that every rank starts as its own process.
READY_TIMEOUT_S = 120.0
#: How long one fork may take once the zygote is ready (it may be importing the script's modules):
#: the command thread waits, and must read the controller's messages again well before the node's
#: fence (--node-timeout-s / 2).
FORK_TIMEOUT_S = 10.0
#: How long the agent waits for a pool's answer (it has imported everything: milliseconds).
CONNECT_TIMEOUT_S = 5.0
_REPLY_BYTES = 1 << 16


class ForkedRank:
    """A rank's process forked by the zygote: what the agent uses of a ``subprocess.Popen``."""

    def __init__(self, pid: int, stdout: BinaryIO, zygote: Zygote) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._zygote = zygote

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, timeout_s=0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, timeout_s=timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout or 0.0)
        return self.returncode


class Zygote:
    """The node's zygote process and what it told us (see the module docstring). States:
    starting/ready (one object: orders wait for its imports) -> unusable (timed out, refused,
    gone: :meth:`fork` returns None from then on); ``close`` ends it and its ranks."""

    def __init__(self, popen: subprocess.Popen | None, sock: socket.socket, hello: dict | None = None) -> None:
        self._popen = popen  # None: a pool's zygote for this agent (agent/pool.py), not our child
        self.kind = "zygote" if popen is not None else "pool"
        self._pid = popen.pid if popen is not None else int((hello or {}).get("pid", 0))
        self._sock = sock
        self._cond = threading.Condition()
        self._replies: dict[int, dict] = {}
        self._codes: dict[int, int] = {}  # pid -> exit code of every child that ended
        self._forked: set[int] = set()
        self._abandoned: set[int] = set()  # orders given up on: a late fork of one is killed at once
        self._next_id = 0
        self._gone = False
        self._ready = hello is not None
        self.unusable = ""  # why no more ranks are forked ("": they are)
        self._reader = threading.Thread(target=self._read, name="unbroken-zygote", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, omp_num_threads: int, run_dir: str = "") -> Zygote | None:
        """Start the zygote; None where it cannot be (it is only a speed-up). ``run_dir`` goes into its
        environment (no part of a rank's: that comes with each order) to tell whose it is."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ, OMP_NUM_THREADS=str(omp_num_threads), PYTHONUNBUFFERED="1")
        if run_dir:
            env[ENV_RUN_DIR] = run_dir
        try:
            # -P as for a spare: the working directory cannot shadow the installed package.
            popen = subprocess.Popen([sys.executable, "-u", "-P", "-m", "unbroken.agent.zygote", str(theirs.fileno())],
                                     env=env, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                                     start_new_session=True, preexec_fn=die_with_parent)
        except OSError as exc:
            log.warning("unbroken agent: no zygote (%s): ranks start as their own processes", exc)
            ours.close()
            return None
        finally:
            theirs.close()
        return cls(popen, ours)

    @classmethod
    def connect(cls, path: Path, timeout_s: float = CONNECT_TIMEOUT_S) -> Zygote | None:
        """This agent's zygote from the pool listening on ``path`` (agent/pool.py); None where there is
        none, or it may not be used (another user's, another build): then the agent starts its own."""
        problem = pool.private_dir_problem(path.parent)
        if problem:
            log.warning("unbroken agent: not using the pool at %s: %s", path, problem)
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(timeout_s)
            sock.connect(str(path))
            if pool.peer_uid(sock) != os.getuid():
                raise OSError(f"the process listening on {path} is not this user's")
            hello = json.loads(sock.recv(_REPLY_BYTES) or b"{}")
            sock.settimeout(None)
        except (OSError, ValueError) as exc:
            sock.close()
            log.warning("unbroken agent: not using the pool at %s (%s): starting a zygote", path, exc)
            return None
        theirs = hello.get("build") if isinstance(hello.get("build"), dict) else {}
        why = hello.get("refused_pool") or ("" if hello.get("ready") else "it did not say ready")
        why = why or "; ".join(f"its {k} is {theirs.get(k)!r}, this agent's {v!r}"
                               for k, v in zygote_build().items() if theirs.get(k) != v)
        if why:
            sock.close()
            log.warning("unbroken agent: not using the pool at %s: %s; starting a zygote", path, why)
            return None
        return cls(None, sock, hello)

    @property
    def pid(self) -> int:
        return self._pid

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> bool:
        """Wait until the zygote finished its imports; False (and it forks nothing) if it did not in time."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._ready and not self._gone and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            ready = self._ready
        if not ready:
            self._give_up("gone before its imports were done" if self._gone else f"not ready within {timeout_s:.0f} s")
        return ready

    def fork(self, env: dict[str, str], argv: list[str], timeout_s: float = FORK_TIMEOUT_S) -> ForkedRank | None:
        """A rank running ``argv`` with exactly ``env``, forked by the zygote; None when it cannot."""
        if self.unusable:
            return None
        with self._cond:
            self._next_id += 1
            order_id = self._next_id
        read_fd, write_fd = os.pipe()
        try:
            order = json.dumps({"id": order_id, "env": env, "argv": argv, "cwd": os.getcwd()}).encode()
            socket.send_fds(self._sock, [order], [write_fd])
        except OSError as exc:
            os.close(read_fd)
            self._give_up(f"could not send an order: {exc}")
            return None
        finally:
            os.close(write_fd)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while order_id not in self._replies and not self._gone and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            reply = self._replies.pop(order_id, None)
            if reply is None:
                self._abandoned.add(order_id)
        if reply is None or "pid" not in reply:
            os.close(read_fd)
            why = ("gone" if self._gone else f"not ready within {timeout_s:.0f} s") if reply is None \
                else str(reply.get("refused"))
            self._give_up(why)
            return None
        return ForkedRank(int(reply["pid"]), os.fdopen(read_fd, "rb"), self)

    def pre_import(self, modules: list[str]) -> None:
        """Have the zygote import what the job's script imported (agent/zygote.py)."""
        if not self.unusable:
            try:
                self._sock.send(json.dumps({"imports": modules}).encode())
            except OSError as exc:
                self._give_up(f"could not send the imports: {exc}")

    def exit_code(self, pid: int, timeout_s: float | None) -> int | None:
        """The exit code of forked rank ``pid`` once the zygote reported it (None: still running)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while pid not in self._codes:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)
            return self._codes[pid]

    def close(self) -> None:
        """End the zygote; its ranks die with it (PR_SET_PDEATHSIG): stop them first. Idempotent."""
        if self.unusable == "closed":
            return
        self.unusable = "closed"
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self._pid:
            _kill_group(self._pid)  # (a pool's zygote runs in its own session; the pool reaps it)
        if self._popen is not None:
            self._popen.wait()
        self._reader.join(timeout=1.0)
        self._sock.close()

    def _give_up(self, why: str) -> None:
        if not self.unusable:
            self.unusable = why
            log.warning("unbroken agent: the zygote (pid %d) forks no more ranks (%s): they start as their "
                        "own processes", self._pid, why)

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(_REPLY_BYTES)
            except OSError:
                data = b""
            if not data:
                break
            msg = json.loads(data)
            with self._cond:
                if "ready" in msg:
                    self._ready = True
                    self._pid = self._pid or int(msg.get("pid", 0))
                elif "exited" in msg:
                    self._codes[int(msg["exited"])] = int(msg["code"])
                elif msg.get("id") in self._abandoned:
                    if "pid" in msg:  # forked after its order timed out: nobody holds it
                        _kill_group(int(msg["pid"]))
                else:
                    self._replies[msg["id"]] = msg
                    if "pid" in msg:
                        self._forked.add(int(msg["pid"]))
                self._cond.notify_all()
        with self._cond:  # the zygote is gone, and its ranks with it (PR_SET_PDEATHSIG)
            self._gone = True
            for pid in self._forked - set(self._codes):
                self._codes[pid] = -signal.SIGKILL
            self._cond.notify_all()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
