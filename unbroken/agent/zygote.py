"""The zygote: one process per node that imports torch once, then forks the node's ranks.

Importing torch (and ``torch._dynamo``, which the first optimizer or DDP imports) is most of a
rank's start-up: seconds of CPU per process, paid by every rank at once when a job starts. The
agent starts this process first thing; it does the imports and the spare's warm-up
(agent/spare.py) once, then waits for orders on a Unix socket (``SOCK_SEQPACKET``, fd given as
its one argument). The agent's side is agent/forks.py.

Messages, JSON, one per packet:

* agent -> zygote ``{"id": n, "env": {...}, "argv": [...], "cwd": dir}`` with one fd attached: the write
  end of the rank's output pipe. The zygote forks; the child becomes the rank (below).
* agent -> zygote ``{"imports": [name, ...]}``: the modules the job's script imported, imported
  here too (as a warm spare does: agent/spare.py), so a rank forked later finds them.
* zygote -> agent ``{"ready": true, "pid": p, "build": {...}}`` once, after its imports (``build``: what
  its ranks run on, :func:`build`); ``{"id": n, "pid": p}``, or ``{"id": n, "refused": why}`` (the agent
  starts that rank the usual way); ``{"exited": p, "code": c}`` when a child ends (``c`` as
  ``Popen.returncode``: negative for a signal).

Fork safety: the zygote is single-threaded (no Python thread, and it checks /proc that torch
started no native one, e.g. an OpenMP pool) whenever it forks; otherwise it refuses every
order from then on. It never initializes a device. The order's environment, secrets included,
travels over the socket, never on a command line.

The child, before it runs the script: its own session (the agent signals the process group),
SIGKILL when the zygote dies (which dies with the agent), fds 0/1/2 = /dev/null and the pipe,
the environment replaced by the order's, named ``unbroken-r<rank>`` (its command line is the
zygote's; /proc/<pid>/environ shows the zygote's start environment, run directory included), the RNGs a fresh interpreter would have reseeded,
then the script as ``__main__`` as a warm spare runs it.
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import select
import signal
import socket
import sys
from collections.abc import Callable
from typing import NoReturn

from unbroken.agent.processes import die_with_parent
from unbroken.agent.spare import pre_import, run_as_main, warm_up
from unbroken.protocol.messages import spare_import_names

MAX_ORDER_BYTES = 1 << 20  # an order is an environment and an argv: far below this


def main() -> None:
    load()
    sock = socket.socket(fileno=int(sys.argv[1]))
    order, out_fd = serve(sock)  # returns only in a forked child
    become_rank(order, out_fd)


def load() -> None:
    """What makes forking worth it: torch, the modules the first step needs, the spare's warm-up."""
    import torch  # noqa: F401  - the point of the zygote
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    import unbroken.worker.entry  # noqa: F401  - what unbroken.init() imports

    warm_up()
    # What exists now lives as long as the process: out of the collector's sight. A forked rank's
    # collections skip it (and leave its pages shared with the zygote), and so does the interpreter's
    # last collection at exit, which otherwise takes most of a second after the script ended.
    gc.freeze()


def build() -> dict[str, str]:
    """What a rank forked here runs on: the interpreter, unbroken's source, torch's version and the
    import path. An agent uses a pool (agent/pool.py) only where these equal its own."""
    import unbroken

    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = ""
    return {"python": os.path.realpath(sys.executable), "prefix": sys.prefix,
            "unbroken": os.path.dirname(os.path.abspath(unbroken.__file__)), "torch": torch_version,
            "pythonpath": os.environ.get("PYTHONPATH", "")}


def serve(sock: socket.socket) -> tuple[dict, int]:
    """The zygote's loop: fork on each order, report each child's exit. Returns in a child only;
    in the zygote it exits when the agent closes the socket (its children then die with it)."""
    _send(sock, {"ready": True, "pid": os.getpid(), "build": build()})
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    refused = ""
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            reap(lambda pid, code: _send(sock, {"exited": pid, "code": code}))
        if sock not in ready:
            continue
        data, fds, _, _ = socket.recv_fds(sock, MAX_ORDER_BYTES, 1)
        if not data:
            sys.exit(0)  # the agent is gone or done
        order = json.loads(data)
        if "imports" in order:
            for fd in fds:
                os.close(fd)
            pre_import(spare_import_names(order["imports"]))  # a thread one starts: no fork after (below)
            continue
        refused = refused or threads_started()
        if refused or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            _send(sock, {"id": order.get("id"), "refused": refused or "no output pipe attached"})
            continue
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wake_r, wake_w):
                os.close(fd)
            sock.close()
            return order, fds[0]
        os.close(fds[0])
        _send(sock, {"id": order["id"], "pid": pid})


def run_rank(order: dict, out_fd: int) -> NoReturn:
    """:func:`become_rank`, ended as the interpreter ends a script, whatever frames lie below this one
    (a pool's command line): SystemExit passes, another exception is printed and exits with 1."""
    try:
        become_rank(order, out_fd)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - as `python script.py` reports an uncaught exception
        sys.excepthook(type(exc), exc, exc.__traceback__)
        raise SystemExit(130 if isinstance(exc, KeyboardInterrupt) else 1) from None
    raise SystemExit(0)


def become_rank(order: dict, out_fd: int) -> None:
    """In the forked child: make this process what ``python -u script args`` started by the
    agent would be (see the module docstring), then run the script."""
    zygote = os.getppid()
    os.setsid()
    die_with_parent()
    if os.getppid() != zygote:  # the zygote died before the line above: do not outlive it
        os._exit(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(devnull)
    os.close(out_fd)
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in order["env"].items()})
    if order.get("cwd"):
        os.chdir(order["cwd"])  # the agent's (a pool was started elsewhere)
    _threads_as_ordered()
    _name_process(f"unbroken-r{os.environ.get('RANK', '')}")  # its cmdline is the zygote's: name it for ps/top
    # `random` reseeds itself in a forked child (os.register_at_fork); numpy's global RNG does not.
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    run_as_main([str(a) for a in order["argv"]])


def _threads_as_ordered() -> None:
    """torch read OMP_NUM_THREADS when the zygote imported it: set the order's, if it differs."""
    import torch

    wanted = os.environ.get("OMP_NUM_THREADS", "")
    if wanted.isdigit() and int(wanted) >= 1 and torch.get_num_threads() != int(wanted):
        torch.set_num_threads(int(wanted))


def _name_process(name: str) -> None:
    """This process's name as ps, top and psutil's ``name()`` show it (Linux: 15 bytes at most)."""
    try:
        with open("/proc/self/comm", "w", encoding="ascii") as f:
            f.write(name[:15])
    except OSError:
        pass


def threads_started() -> str:
    """Why forking is unsafe now ("" when it is safe): more than this one thread."""
    try:
        n = len(os.listdir("/proc/self/task"))
    except OSError:
        return "cannot count this process's threads (/proc/self/task)"
    return "" if n == 1 else f"the zygote has {n} threads (a fork would copy locks held by the others)"


def reap(report: Callable[[int, int], None] | None = None) -> None:
    """Collect every child that ended, without blocking; ``report(pid, exit_code)`` for each (the
    code as ``Popen.returncode``: negative for a signal)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if report is not None:
            report(pid, os.waitstatus_to_exitcode(status))


def _send(sock: socket.socket, msg: dict) -> None:
    try:
        sock.send(json.dumps(msg).encode())
    except OSError:
        sys.exit(0)  # the agent is gone: nothing to report to


if __name__ == "__main__":
    main()
