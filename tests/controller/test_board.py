"""The controller's Board: the one owner of what its connections and executor share (milliseconds),
and the rule that keeps it so: no other module of the controller writes a rank's view."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from unbroken.controller.board import Board
from unbroken.controller.views import Outcome, RankView
from unbroken.names import Phase, WorkerState

pytestmark = pytest.mark.timeout(10)

PACKAGE = Path(__file__).resolve().parents[2] / "unbroken"


def test_standby_agents_get_ids_after_the_nodes_and_a_stale_connection_leaves_nothing():
    board = Board(world_size=4, nnodes=2)
    a, b, c = object(), object(), object()
    assert board.agent_joined(0, a, standby=False) == 0
    assert board.agent_joined(0, b, standby=True) == 2  # after node 1, whether or not it joined
    assert board.agent_joined(0, c, standby=True) == 3
    assert not board.agent_left(2, a)  # not agent 2's connection
    assert board.agent_left(2, b) and board.agent_ids() == [0, 3] and board.agent_conn(2) is None


def test_a_steady_step_is_timed_and_the_first_of_a_generation_is_not():
    board = Board(world_size=1, nnodes=1)
    board.process_started(0, pid=7, attempt=0, now=10.0)
    assert board.step_done(0, 1, {"compute_s": 0.2}, now=11.0) is None  # the first step of the attempt
    assert board.step_done(0, 2, {"compute_s": True}, now=11.5) == 0.5  # (a bool is no time)
    w = board.view(0)
    assert (w.step, w.steps_in_generation, list(w.compute_s)) == (2, 2, [0.2])
    board.recovered(now=20.0)
    assert board.step_done(0, 3, {}, now=21.0) is None  # the redo step after a recovery is a first one


def test_the_recovery_deadline_expires_once_and_a_job_finishes_once():
    board = Board(world_size=1, nnodes=1)
    board.recovery_ordered(gen=3, deadline_t=5.0)
    assert board.recovery_expired(5.0) is None and board.recovery_expired(5.1) == 3
    assert board.recovery_expired(9.0) is None and board.recovery_deadline is None
    assert board.finish(Outcome(0, "done")) and not board.finish(Outcome(1, "later"))
    assert board.outcome.reason == "done" and not board.is_done()  # done once the executor told everyone
    board.close()
    assert board.wait(0) and board.is_done()


def test_a_process_status_of_another_process_changes_nothing():
    board = Board(world_size=2, nnodes=1)
    board.process_started(1, pid=11, attempt=0, now=0.0)
    assert not board.process_status(1, pid=12, attempt=0, status="stopped", now=1.0)
    assert not board.process_status(1, pid=11, attempt=1, status="stopped", now=1.0)
    assert board.process_status(1, pid=11, attempt=0, status="stopped", now=1.0)
    assert (board.view(1).process, board.view(1).process_t) == ("stopped", 1.0)
    board.reported(1, Phase.FINISHED, in_loop=True)
    board.finishing(1)
    assert board.process_exited(1, exit_code=None, now=5.0) and board.view(1).state is WorkerState.FAILED


def test_the_counts_are_a_copy():
    board = Board(world_size=1, nnodes=1)
    board.count_received("Progress")
    board.count_sent("CommitStep", relayed=True)
    counts = board.counts
    counts.received["Progress"] += 5
    assert board.counts.received == {"Progress": 1}
    assert (board.counts.sent, board.counts.relayed) == ({"CommitStep": 1}, {"CommitStep": 1})


def _view_writes(path: Path) -> list[str]:
    """``x.<field> = ...`` (or ``x.compute_s.append/clear``) of a RankView field, x not ``self``."""
    fields = {f.name for f in dataclasses.fields(RankView)} - {"rank"}
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr in fields):
            continue
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            continue  # a class's own attribute of that name
        up = parents.get(node)
        mutated = isinstance(up, ast.Attribute) and up.attr in ("append", "clear") and isinstance(parents.get(up), ast.Call)
        if isinstance(node.ctx, ast.Store) or mutated:
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} .{node.attr}")
    return found


def test_no_controller_module_but_the_board_writes_a_ranks_view():
    writes = [w for path in sorted((PACKAGE / "controller").glob("*.py")) if path.name != "board.py"
              for w in _view_writes(path)]
    assert writes == []
    assert _view_writes(PACKAGE / "controller" / "board.py")  # the check sees the writes where they are
