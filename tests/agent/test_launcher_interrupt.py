"""Ctrl-C of `unbroken run`: the job ends with the interruption's exit code, whatever the controller
decided from the agent's clean-up first (found by the slow set under load: exit 1, "the agent of node
0 was lost", instead of 130)."""

from __future__ import annotations

import signal

import pytest

from unbroken.agent import launcher
from unbroken.config import LaunchConfig

pytestmark = pytest.mark.timeout(60)


class _InterruptedAgent:
    """An agent whose clean-up on Ctrl-C reached the controller, as a lost node, before the
    launcher's abort did: the controller has finished the job as failed, then run() raises."""

    controller = None

    def __init__(self, *args, **kwargs) -> None:
        pass

    def run(self):
        _InterruptedAgent.controller.abort("the agent of node(s) [0] was lost", 1)
        raise self.exc


@pytest.mark.parametrize("exc, code", [(KeyboardInterrupt(), 130), (launcher.Terminated(), 128 + signal.SIGTERM)])
def test_an_interruption_keeps_its_exit_code(tmp_path, monkeypatch, exc, code):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    cfg = launcher.resolve(LaunchConfig(script=str(script), nproc_per_node=1, run_dir=str(tmp_path / "run"),
                                        master_addr="127.0.0.1", master_port=0))
    monkeypatch.setattr(_InterruptedAgent, "exc", exc, raising=False)
    monkeypatch.setattr(launcher, "Agent", _InterruptedAgent)
    result = launcher.run_job(cfg, on_controller=lambda c: setattr(_InterruptedAgent, "controller", c))
    assert result.exit_code == code, result.reason
    assert "interrupted" in result.reason or "terminated" in result.reason
