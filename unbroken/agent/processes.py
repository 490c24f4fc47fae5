"""The OS side of the agent's processes: workers and spares die with their agent, their state
as /proc says, and a signal to a process group. Functions; any thread of the agent."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess

import psutil

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """In the child before exec: SIGKILL it if the agent dies, so no worker outlives its agent."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the agent's own clean-up still stops workers
        pass


def process_state(pid: int) -> str:
    """running | stopped (SIGSTOP, a debugger) | zombie, as /proc says (psutil)."""
    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "zombie"  # gone: the watcher reports its exit
    except psutil.Error:
        return "running"
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return "stopped"
    return "zombie" if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) else "running"


def signal_group(popen: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
