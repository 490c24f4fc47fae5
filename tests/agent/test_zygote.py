"""The node's zygote (agent/zygote.py, agent/forks.py): a rank forked from it is the process the
agent would have started (its own session, exactly the order's environment, the secret on no
command line, its output on the agent's pipe, its exit code or signal reported), and the zygote
refuses to fork once a thread runs in it. A real zygote (it imports torch once)."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from unbroken.agent.forks import Zygote

CHILD = """
import os, sys
print("rank", os.environ["RANK"], "secret", os.environ["UNBROKEN_SECRET"], "stray", os.environ.get("STRAY"),
      "argv", sys.argv[1:], "session", os.getsid(0) == os.getpid(), "torch", "torch" in sys.modules, flush=True)
if sys.argv[1] == "sleep":
    import time
    time.sleep(60)
sys.exit(3)
"""
THREAD_MODULE = "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"


@pytest.mark.timeout(180)
def test_a_forked_rank_is_the_process_the_agent_would_start(tmp_path, monkeypatch):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    (tmp_path / "starts_a_thread.py").write_text(THREAD_MODULE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("STRAY", "from the agent")  # not in the order: the rank must not see it
    env = {"RANK": "2", "UNBROKEN_SECRET": "s3cr3t", "PATH": os.environ.get("PATH", "")}
    zygote = Zygote.start(omp_num_threads=1)
    assert zygote is not None
    try:
        assert zygote.wait_ready(), zygote.unusable  # its imports (the agent waits so before it joins)
        rank = zygote.fork(env, [str(script), "exit"])
        assert rank is not None, zygote.unusable
        line = rank.stdout.readline().decode()
        assert line.split() == ["rank", "2", "secret", "s3cr3t", "stray", "None", "argv", "['exit']",
                                "session", "True", "torch", "True"]
        assert rank.wait(timeout=60) == 3 and rank.poll() == 3

        sleeper = zygote.fork(env, [str(script), "sleep"])
        assert sleeper is not None
        assert sleeper.stdout.readline()  # it runs
        proc = psutil.Process(sleeper.pid)
        assert proc.ppid() == zygote.pid and "s3cr3t" not in " ".join(proc.cmdline())
        assert proc.name() == "unbroken-r2"
        assert sleeper.poll() is None
        os.killpg(sleeper.pid, signal.SIGKILL)  # as the agent kills a rank: its process group
        assert sleeper.wait(timeout=30) == -signal.SIGKILL

        # Fork safety: once a module the script imported starts a thread in the zygote, no more forks.
        zygote.pre_import(["starts_a_thread"])
        assert zygote.fork(env, [str(script), "exit"]) is None
        assert "threads" in zygote.unusable
    finally:
        zygote.close()
    assert not psutil.pid_exists(zygote.pid)
    rank.stdout.close()
    sleeper.stdout.close()
