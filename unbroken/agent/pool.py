"""A pool: a zygote that outlives jobs, so a job's ranks start without importing torch at all.

The node's zygote (agent/zygote.py) imports torch once per job; that import (2-3 s of CPU here,
more on a loaded node) is most of what is left between a launch and its first step. ``unbroken
pool`` runs the same imports once per machine and user, then listens on a Unix socket
(``SOCK_SEQPACKET``, :func:`default_socket` unless ``--socket``). An agent that finds a pool there
(agent/forks.py :meth:`~unbroken.agent.forks.Zygote.connect`) uses it instead of starting its own
zygote: for each agent connection the pool forks one child, which is a zygote for that agent only
(the same protocol and fork rules as agent/zygote.py; its own session; the script's modules are
imported into it, never into the pool, so nothing of one job is left for the next), and which
ends, with its ranks, when the agent's connection closes.

Who may use it: the socket lives in a directory only its user can enter (0700, created here,
refused when another user owns it or others may enter it), and the pool serves only peers whose
uid (``SO_PEERCRED``) is its own. The orders carry the job's secret in the rank's environment, as
they do to a zygote: over that socket, never on a command line. An agent uses a pool only when it
runs the same interpreter, unbroken source, torch version and import path as itself
(:func:`unbroken.agent.zygote.build`); otherwise it starts its own zygote, with a warning.

Runs in the foreground (``unbroken pool``) until SIGTERM or SIGINT, then removes its socket; its
agents' zygotes and their ranks are not stopped by that (their jobs go on; each ends with its agent).
Single-threaded throughout: it forks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from unbroken.errors import ConfigError

log = logging.getLogger(__name__)

SOCKET_NAME = "pool.sock"
#: How long :func:`running` waits for a new pool's imports (seconds of CPU; a minute on a loaded machine).
READY_TIMEOUT_S = 120.0


def default_socket() -> Path:
    """``$XDG_RUNTIME_DIR/unbroken/pool.sock``, or ``/tmp/unbroken-<uid>/pool.sock`` without one."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    base = Path(runtime) / "unbroken" if runtime else Path(f"/tmp/unbroken-{os.getuid()}")
    return base / SOCKET_NAME


def private_dir_problem(directory: Path) -> str:
    """Why ``directory`` may not hold a pool's socket ("" when it may): it must be ours, not a
    symlink, and closed to everyone else."""
    try:
        st = os.lstat(directory)
    except OSError as exc:
        return f"{directory}: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{directory} is not a directory"
    if st.st_uid != os.getuid():
        return f"{directory} belongs to uid {st.st_uid}, not to this user ({os.getuid()})"
    if st.st_mode & 0o077:
        return f"{directory} is open to other users (mode {stat.S_IMODE(st.st_mode):o}; 700 is required)"
    return ""


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED: pid, uid, gid)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def serve(path: Path, on_ready=None) -> None:
    """Import, listen on ``path``, fork a zygote per agent connection until SIGTERM/SIGINT."""
    from unbroken.agent import zygote

    listener = _listen(path)
    owner, stop = os.getpid(), []  # (the forked children must not remove the socket on their way out)

    def ask_stop(signum, _frame) -> None:
        stop.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, ask_stop)
    signal.signal(signal.SIGINT, ask_stop)
    signal.signal(signal.SIGCHLD, lambda *_: zygote.reap())  # the agents' zygotes, once they end
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch reads it; each rank sets its job's
        zygote.load()
        if on_ready is not None:
            on_ready(path)
        while True:
            conn, _ = listener.accept()
            child = _serve_one(conn, listener)
            if child is not None:  # in the forked child: a zygote for this agent, then (in a rank) the script
                zygote.run_rank(*child)  # ends the process as the interpreter ends a script (SystemExit)
    except KeyboardInterrupt:
        if not stop:
            raise
    finally:
        if os.getpid() == owner:
            listener.close()
            try:
                path.unlink()
            except OSError:
                pass


def _listen(path: Path) -> socket.socket:
    directory = path.parent
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"pool socket directory {directory}: {exc.strerror}") from None
    problem = private_dir_problem(directory)
    if problem:
        raise ConfigError(f"the pool's socket cannot go there: {problem}")
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ConfigError(f"{path} exists and is not a socket: give another --socket (nothing was removed)")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect(str(path))
            raise ConfigError(f"a pool already listens on {path} (stop it, or give another --socket)")
        except OSError:
            path.unlink()  # a stale socket of a pool that is gone
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old_umask = os.umask(0o177)
    try:
        listener.bind(str(path))
    finally:
        os.umask(old_umask)
    listener.listen(64)
    return listener


def _serve_one(conn: socket.socket, listener: socket.socket) -> tuple[dict, int] | None:
    """Fork this connection's zygote. In the pool: None (at once). In the child: only in a rank."""
    from unbroken.agent import zygote

    try:
        uid = peer_uid(conn)
    except OSError:
        uid = -1
    why = "" if uid == os.getuid() else f"uid {uid} is not this pool's user"
    why = why or zygote.threads_started()
    if why:
        log.warning("unbroken pool: refused a connection: %s", why)
        _refuse(conn, why)
        return None
    pid = os.fork()
    if pid:
        conn.close()
        return None
    # The child: this agent's zygote, in its own session (the agent kills its group at the end).
    listener.close()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as in a process the agent started
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setsid()
    for handler in logging.root.handlers[:]:  # the command line's logging set-up is not the script's
        logging.root.removeHandler(handler)
    logging.root.setLevel(logging.WARNING)
    try:
        return zygote.serve(conn)  # returns only in a rank; exits when the agent is gone
    except SystemExit as exc:  # never the pool's clean-up: leave at once
        os._exit(exc.code if isinstance(exc.code, int) else 0)
    except BaseException:  # noqa: BLE001
        os._exit(1)


def _refuse(conn: socket.socket, why: str) -> None:
    try:
        conn.send(json.dumps({"refused_pool": why}).encode())
    except OSError:
        pass
    conn.close()


@contextlib.contextmanager
def running(path: Path, timeout_s: float = READY_TIMEOUT_S) -> Iterator[Path | None]:
    """A pool process (`unbroken pool --socket path`) for the duration of the block: yields ``path``
    once it is ready, None where it could not start (launches then start their own zygote). For a
    caller that runs several jobs in a row (the demo, a benchmark); stopped with SIGTERM at the end."""
    popen = subprocess.Popen([sys.executable, "-m", "unbroken.cli.main", "pool", "--socket", str(path)],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
    assert popen.stdout is not None
    try:
        ready, _, _ = select.select([popen.stdout], [], [], timeout_s)
        line = popen.stdout.readline().decode(errors="replace") if ready else ""
        if "ready" not in line:
            log.warning("unbroken: the pool did not start (%s): launches start their own zygote",
                        line.strip() or f"not ready within {timeout_s:.0f} s")
        yield path if "ready" in line else None
    finally:
        popen.terminate()
        try:
            popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()
        popen.stdout.close()
