"""The metrics port: Prometheus ``/metrics``, ``/status.json`` and a live page ``/``.

:class:`MetricsServer` runs a small threaded HTTP server (the standard library's) in its own
daemon thread, in the controller's process, bound to the controller's host (127.0.0.1
unless the job's ``--master-addr`` says otherwise). It serves read-only views of the
:class:`~unbroken.ops.live_view.LiveView`; nothing it receives is parsed beyond the path.
It is not authenticated (a Prometheus scraper carries no job secret): like the control
plane, run it on a trusted network.

The page is plain HTML that reloads itself every 2 s (``<meta http-equiv="refresh">``): the
rank table and the timeline as inline SVG, no JavaScript.
"""

from __future__ import annotations

import html
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST

from unbroken.errors import ConfigError
from unbroken.ops.timeline import CATEGORY_COLORS, STATE_COLORS, Timeline, build

REFRESH_S = 2


class _Exposition(Protocol):
    def exposition(self) -> bytes: ...


class LiveView(Protocol):
    """What the server reads of :class:`unbroken.ops.live_view.LiveView` (not imported: it
    imports this module)."""

    metrics: _Exposition

    def status(self) -> dict[str, Any]: ...

    def timeline_events(self) -> list[dict[str, Any]]: ...


class MetricsServer:
    """Serves one job's live view on ``host:port`` (port 0: a free one) until :meth:`close`."""

    def __init__(self, view: LiveView, host: str, port: int) -> None:
        handler = type("Handler", (_Handler,), {"view": view})
        try:
            self._httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise ConfigError(f"--metrics-port {port}: cannot listen on {host}:{port}: {exc} "
                              "(give a free port, or 0 for any free one)") from exc
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="unbroken-metrics-http", daemon=True)

    @property
    def address(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"{host}:{port}"

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


class _Handler(BaseHTTPRequestHandler):
    view: LiveView

    def do_GET(self) -> None:  # noqa: N802  (http.server's name)
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, CONTENT_TYPE_LATEST, self.view.metrics.exposition())
        elif path == "/status.json":
            self._send(200, "application/json", json.dumps(self.view.status(), default=str).encode())
        elif path in ("/", "/index.html"):
            self._send(200, "text/html; charset=utf-8", page(self.view.status(),
                                                             self.view.timeline_events()).encode())
        else:
            self._send(404, "text/plain", b"not found: try /, /metrics or /status.json\n")

    def _send(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (library code does not print)
        pass


_STYLE = """body{font:14px sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f3f3f3}
td.l{text-align:left}.state-running{color:#2e7d32}.state-failed{color:#c62828}h1{font-size:18px}"""


def page(status: dict[str, Any], events: list[dict[str, Any]]) -> str:
    """The live page: job line, rank table, timeline (SVG)."""
    e = html.escape
    rows = "".join(
        f'<tr id="rank-{r["rank"]}"><td>{r["rank"]}</td><td>{r["pid"]}</td>'
        f'<td class="l state-{e(str(r["state"]))}">{e(str(r["state"]))}</td><td>{_num(r["step"])}</td>'
        f'<td class="l">{e(str(r["phase"]))}</td><td>{_num(r["step_s"], 3)}</td><td>{_num(r["loss"], 4)}</td>'
        f'<td>{r["generation"]}</td><td class="l">{e(r["last_fault"] or "-")}</td></tr>' for r in status["ranks"])
    head = "".join(f"<th>{h}</th>" for h in ("rank", "pid", "state", "step", "phase", "step s", "loss",
                                              "generation", "last fault"))
    return (f'<!doctype html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_S}">'
            f'<title>unbroken job {e(status["job_id"])}</title><style>{_STYLE}</style></head><body>'
            f'<h1>unbroken job {e(status["job_id"])}: {e(status["phase"])}</h1>'
            f'<p>step {status["job_step"]} &middot; attempt {status["attempt"]} &middot; generation '
            f'{status["generation"]} &middot; ranks alive {status["ranks_alive"]}/{status["world_size"]} &middot; '
            f'goodput {100 * status["goodput"]:.1f}% &middot; updated {time.strftime("%H:%M:%S")}</p>'
            f'<table id="ranks"><tr>{head}</tr>{rows}</table><h2>timeline</h2>'
            f'{svg(build(events, now_t=time.time()))}</body></html>')


def _num(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def svg(tl: Timeline, width: int = 1000) -> str:
    """The timeline as SVG: goodput bar on top, one lane per rank, fault markers."""
    lane_h, top, left = 18, 34, 60
    height = top + lane_h * tl.world_size + 30
    scale = (width - left - 10) / max(tl.wall_s, 1e-3)
    x = lambda t: left + t * scale  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" id="timeline">']
    for c, a, b in tl.intervals:  # where the time went, as one bar
        parts.append(f'<rect x="{x(a):.1f}" y="4" width="{max(0.5, (b - a) * scale):.1f}" height="14" '
                     f'fill="{CATEGORY_COLORS[c]}"><title>{c} {b - a:.2f} s</title></rect>')
    for rank, spans in tl.rank_states.items():
        y = top + rank * lane_h
        parts.append(f'<text x="2" y="{y + 13}" font-size="12">rank {rank}</text>')
        for state, a, b in spans:
            parts.append(f'<rect x="{x(a):.1f}" y="{y}" width="{max(0.5, (b - a) * scale):.1f}" '
                         f'height="{lane_h - 3}" fill="{STATE_COLORS[state]}"><title>{state}</title></rect>')
    for m in (m for m in tl.markers if m.kind == "fault"):
        parts.append(f'<line x1="{x(m.t):.1f}" x2="{x(m.t):.1f}" y1="{top - 4}" y2="{height - 24}" '
                     f'stroke="#b71c1c" stroke-dasharray="3,2"><title>{html.escape(m.label)}</title></line>')
        parts.append(f'<text x="{x(m.t) + 2:.1f}" y="{top - 6}" font-size="10" fill="#b71c1c">'
                     f'{html.escape(m.label)}</text>')
    legend = " ".join(f'{c}' for c in CATEGORY_COLORS)
    parts.append(f'<text x="{left}" y="{height - 8}" font-size="11">0 s .. {tl.wall_s:.1f} s; top bar: {legend}'
                 '</text></svg>')
    return "".join(parts)
