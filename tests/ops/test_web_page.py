"""The live page on the metrics port, in a real headless browser (Chromium).

Skipped, with the reason, where no Chromium is installed (`apt-get install chromium`). The
page is served by a real MetricsServer over a LiveView fed with event-log records; the
browser loads it, takes a screenshot and dumps the DOM it rendered: each rank's row must be
there, with its state, and the timeline SVG with each rank's lane.
"""

from __future__ import annotations

import shutil
import struct
import subprocess

import pytest

from tests.conftest import free_port
from unbroken.controller.eventlog import EventLog
from unbroken.ops.live_view import LiveView

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
WORLD = 4


def _snapshot() -> dict:
    return {"phase": "running", "attempt": 0, "restarts_used": 0, "median_step_s": 0.05,
            "workers": [{"rank": r, "pid": 1000 + r, "step": 12, "phase": "compute",
                         "state": "running" if r != 2 else "starting",
                         "metrics": {"loss": 2.5 - 0.1 * r, "step_s": 0.05}} for r in range(WORLD)]}


def _chromium(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--window-size=1200,800", *args], capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install chromium) for the browser test")
def test_live_page_shows_every_rank_in_a_real_browser(tmp_path):
    events = EventLog(tmp_path)
    monitor = LiveView(run_dir=tmp_path, job_id="webtest", world_size=WORLD, events=events,
                         snapshot=_snapshot, metrics_port=free_port())
    events.listeners.append(monitor.on_record)
    monitor.start()
    try:
        events.emit("controller_started", world_size=WORLD)
        for r in range(WORLD):
            events.emit("rank_started", rank=r, pid=1000 + r, attempt=0)
        for step in range(1, 13):
            for r in range(WORLD):
                monitor.on_step(r, step, {"step_s": 0.05, "ckpt_s": 0.001})
        events.emit("rank_exited", rank=2, pid=1002, attempt=0, exit_code=None, signal=9, step=12)
        url = f"http://{monitor.address}/"
        shot = tmp_path / "page.png"
        _chromium(f"--screenshot={shot}", url)
        dom = _chromium("--dump-dom", url).stdout
    finally:
        monitor.close()
        events.close()
    assert shot.is_file(), "Chromium wrote no screenshot"
    header = shot.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", header[16:24]) == (1200, 800)
    for r in range(WORLD):
        assert f'id="rank-{r}"' in dom, f"rank {r}'s row is missing from the rendered page"
        assert f">rank {r}</text>" in dom, f"rank {r}'s timeline lane is missing"
    assert "signal 9 at step 12" in dom and 'id="timeline"' in dom
