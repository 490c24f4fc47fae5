"""The goodput breakdown and the timeline, from event logs written by hand (pure functions)."""

from __future__ import annotations

import pytest

from unbroken.ops import goodput, timeline

T0 = 1_000.0


def _log() -> list[dict]:
    """4 ranks: 2 s start-up, 10 steps of 0.1 s (the last 0.02 s of each a checkpoint), a
    SIGKILL of rank 2 at 3.05 s recovered in flight (decision at 3.06 s, resumed at 4.05 s),
    the step in flight redone by 4.15 s, 5 more steps, job finished at 5.0 s."""
    ev = [{"t": T0, "event": "controller_started", "world_size": 4}]
    ev += [{"t": T0 + 0.01 * (r + 1), "event": "rank_started", "rank": r} for r in range(4)]
    t = T0 + 2.0
    for k in range(1, 11):
        t += 0.1
        ev.append({"t": t, "event": "step", "step": k, "step_s": 0.08, "ckpt_s": 0.02})
    ev += [{"t": T0 + 3.05, "event": "rank_exited", "rank": 2, "exit_code": None, "signal": 9, "step": 10},
           {"t": T0 + 3.06, "event": "decision", "rung": "recover-in-place", "rank": 2, "kind": "crash", "step": 10},
           {"t": T0 + 3.07, "event": "rank_paused", "rank": 0, "step": 10},
           {"t": T0 + 4.05, "event": "rank_resumed", "rank": 0, "step": 10},
           {"t": T0 + 4.05, "event": "recovered_in_flight", "detect_s": 0.01, "replace_s": 0.1, "regroup_s": 0.01,
            "restore_s": 0.8, "total_s": 1.0, "steps_redone": 0},
           {"t": T0 + 4.15, "event": "step", "step": 11, "step_s": 0.1, "ckpt_s": 0.0},
           {"t": T0 + 4.15, "event": "recovered", "recover_s": 1.1, "step": 10, "restored_step": 10,
            "tier": "replicas", "attempt": 0}]
    t = T0 + 4.15
    for k in range(12, 16):
        t += 0.1
        ev.append({"t": t, "event": "step", "step": k, "step_s": 0.1, "ckpt_s": 0.0})
    ev.append({"t": T0 + 5.0, "event": "job_finished", "exit_code": 0})
    return ev


def test_rows_add_up_to_the_wall_time_and_each_cause_is_where_it_happened():
    bd = goodput.breakdown(_log())
    s = bd.seconds
    assert bd.wall_s == pytest.approx(5.0)
    assert sum(s.values()) == pytest.approx(bd.wall_s, rel=1e-9)
    assert s["startup"] == pytest.approx(2.0)
    assert s["checkpoint"] == pytest.approx(10 * 0.02)
    assert s["detect"] == pytest.approx(0.01) and s["replace"] == pytest.approx(0.1)
    assert s["regroup"] == pytest.approx(0.01) and s["restore"] == pytest.approx(1.0 - 0.12)
    # redone: the step in flight from the last step (3.0 s) to the fault (2.95 s in: 0.05 s) + the redo
    assert s["redo"] == pytest.approx(0.05 + 0.1)
    assert s["productive"] == pytest.approx(10 * 0.08 + 4 * 0.1)
    assert s["idle"] == pytest.approx(5.0 - 4.55)
    assert bd.goodput == pytest.approx(s["productive"] / 5.0)
    (rec,) = bd.recoveries
    assert (rec.rank, rec.rung, rec.kind) == (2, "recover-in-place", "crash")


def test_a_job_restart_is_split_into_detect_restart_restore_and_redo():
    ev = [{"t": T0, "event": "controller_started", "world_size": 1},
          {"t": T0 + 1.0, "event": "step", "step": 1, "step_s": 0.5},
          {"t": T0 + 1.2, "event": "rank_exited", "rank": 0, "exit_code": 1, "step": 1},
          {"t": T0 + 1.3, "event": "decision", "rung": "exit", "rank": 0, "kind": "exit"},
          {"t": T0 + 3.0, "event": "restored", "rank": 0, "attempt": 1, "step": 1, "tier": "memory", "seconds": 0.4},
          {"t": T0 + 3.5, "event": "recovered", "recover_s": 2.3, "step": 1, "restored_step": 1,
           "tier": "memory", "attempt": 1},
          {"t": T0 + 4.0, "event": "job_finished", "exit_code": 0}]
    bd = goodput.breakdown(ev)
    s = bd.seconds
    assert sum(s.values()) == pytest.approx(4.0)
    assert s["detect"] == pytest.approx(0.1) and s["replace"] == pytest.approx(1.3)
    assert s["restore"] == pytest.approx(0.4) and s["redo"] == pytest.approx(0.2 + 0.5)


def test_a_live_log_ends_now_and_an_empty_log_is_zero():
    ev = _log()[:-1]
    assert goodput.breakdown(ev, now_t=T0 + 6.0).wall_s == pytest.approx(6.0)
    assert goodput.breakdown([]).wall_s == 0.0


def test_timeline_lanes_show_the_killed_rank_down_and_the_others_paused():
    tl = timeline.build(_log())
    assert tl.world_size == 4 and len(tl.job_steps) == 15
    assert any(state == "down" for state, _, _ in tl.rank_states[2])
    assert any(state == "paused" for state, _, _ in tl.rank_states[0])
    assert [m.label for m in tl.markers if m.kind == "fault"] == ["kill r2"]
    assert [m.label for m in tl.markers if m.kind == "decision"] == ["recover-in-place"]


def test_report_and_status_name_a_missing_run_dir(tmp_path, capsys):
    from unbroken.cli.main import main

    assert main(["report", str(tmp_path)]) == 2
    assert "events.jsonl not found" in capsys.readouterr().err
    assert main(["status"]) == 2


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="the [plot] extra (matplotlib) is not installed")
    from unbroken.ops.plot import write_png

    out = write_png(_log(), tmp_path / "t.png")
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_long_jobs_log_in_memory_stays_small_and_its_goodput_the_same(tmp_path, monkeypatch):
    """The controller's event log holds one record per job step; in memory, old runs of them are
    merged (controller/eventlog.py), and the breakdown of what is left is the one of every record."""
    from unbroken.controller import eventlog
    monkeypatch.setattr(eventlog, "KEEP_STEP_RECORDS", 50)
    monkeypatch.setattr(eventlog, "MERGE_STEPS", 20)
    log = eventlog.EventLog(tmp_path)
    clock = [T0]
    monkeypatch.setattr(eventlog.time, "time", lambda: clock[0])
    try:
        every = []

        def emit(dt, name, **fields):
            clock[0] += dt
            every.append(log.emit(name, **fields))

        emit(0.0, "controller_started", world_size=2)
        for k in range(1, 401):  # 400 steps of 0.1 s, 0.02 s of each a checkpoint; a fault at step 200
            emit(0.1, "step", step=k, step_s=0.08, ckpt_s=0.02)
            if k == 200:
                emit(0.05, "rank_exited", rank=1, exit_code=None, signal=9, step=201)
                emit(0.01, "decision", rung="recover-in-place", rank=1, kind="crash", step=201)
                emit(0.5, "recovered", recover_s=0.56, step=201, restored_step=201, tier="replicas", attempt=0)
        emit(0.1, "job_finished", exit_code=0)
        kept = log.records()
        assert len(kept) < 150, f"{len(kept)} records in memory for {len(every)}"
        assert [r["step"] for r in kept if r["event"] == "step"][-50:] == list(range(351, 401))  # the newest, as they are
        assert sum(r.get("steps", 1) for r in kept if r["event"] == "step") == 400
        whole, merged = goodput.breakdown(every), goodput.breakdown(kept)
        for cause in goodput.CATEGORIES:
            assert merged.seconds[cause] == pytest.approx(whole.seconds[cause], abs=1e-6), cause
        assert merged.steps == whole.steps == 400
        assert len(eventlog.read_events(tmp_path)) == len(every)  # the file keeps every record
    finally:
        log.close()
