"""The timeline picture of a run (`unbroken report RUN_DIR --plot out.png`), drawn with matplotlib.

matplotlib is an optional extra (``pip install 'unbroken[plot]'``); without it
:func:`write_png` raises a ConfigError that says so. Three panels, one time axis:
step progress per rank with every recovery phase shaded and every fault and decision
marked; each rank's state (running, paused, hung, down, ...); where the time went.
"""

from __future__ import annotations

import os
from typing import Any

from unbroken.errors import ConfigError
from unbroken.ops import goodput
from unbroken.ops.timeline import CATEGORY_COLORS, STATE_COLORS, Timeline, build

_SHADED = ("detect", "replace", "regroup", "restore", "redo", "checkpoint")


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib, an optional extra: pip install 'unbroken[plot]' "
                          "(or pip install matplotlib)") from None
    return plt


def _progress(ax: Any, tl: Timeline) -> None:
    for c, a, b in tl.intervals:
        if c in _SHADED and b - a > 0:
            ax.axvspan(a, b, color=CATEGORY_COLORS[c], alpha=0.35 if c != "checkpoint" else 0.15, lw=0)
    for rank, pts in sorted(tl.rank_steps.items()):  # widest first, so overlapping ranks all show
        xs = [t for t, s in pts]
        ys = [float("nan") if s is None else s for _, s in pts]
        ax.plot(xs, ys, lw=1 + 2.5 * (tl.world_size - 1 - rank) / max(1, tl.world_size - 1),
                label=f"rank {rank}", alpha=0.9)
    top = max((s for _, s in tl.job_steps), default=1)
    for i, mk in enumerate(m for m in tl.markers if m.kind == "fault"):
        ax.axvline(mk.t, color="#b71c1c", lw=1, ls="--")
        ax.annotate(mk.label, (mk.t, top * (0.95 - 0.09 * (i % 3))), rotation=0, fontsize=8, color="#b71c1c",
                    xytext=(3, 0), textcoords="offset points")
    for mk in (m for m in tl.markers if m.kind == "decision"):
        ax.annotate(mk.label, (mk.t, 0), fontsize=7, color="#1a237e", rotation=90, va="bottom",
                    xytext=(2, 2), textcoords="offset points")
    ax.set_ylabel("steps completed")
    ax.legend(loc="lower right", fontsize=7, ncol=2)
    ax.grid(alpha=0.3)


def _lanes(ax: Any, tl: Timeline) -> None:
    for rank, spans in tl.rank_states.items():
        for state, a, b in spans:
            ax.broken_barh([(a, b - a)], (rank - 0.4, 0.8), color=STATE_COLORS[state])
    ax.set_yticks(range(tl.world_size), [f"rank {r}" for r in range(tl.world_size)])
    ax.invert_yaxis()
    handles = [_patch(STATE_COLORS[s], s) for s in STATE_COLORS]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)


def _where_time_went(ax: Any, tl: Timeline) -> None:
    """The wall time as one bar, in time order, coloured by goodput category (totals in the legend)."""
    bd = tl.breakdown
    for c, a, b in tl.intervals:
        ax.barh(0, b - a, left=a, color=CATEGORY_COLORS[c], lw=0)
        if (b - a) / max(tl.wall_s, 1e-9) > 0.06:
            ax.text((a + b) / 2, 0, f"{c}\n{b - a:.1f}s", ha="center", va="center", fontsize=7)
    ax.set_yticks([])
    ax.set_xlabel("seconds since the job started")
    handles = [_patch(CATEGORY_COLORS[c], f"{c} {bd.seconds.get(c, 0.0):.1f}s") for c in goodput.CATEGORIES
               if bd and bd.seconds.get(c, 0.0) > 0.0005]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.3), fontsize=7)
    ax.set_title(f"where the time went: goodput {100 * (bd.goodput if bd else 0):.1f}% of {tl.wall_s:.1f} s",
                 fontsize=9, loc="left")


def _patch(color: str, label: str) -> Any:
    from matplotlib.patches import Patch

    return Patch(color=color, label=label)


def write_png(events: list[dict[str, Any]], path: str | os.PathLike, title: str = "") -> str:
    """Draw the run's timeline into ``path`` (PNG); returns the path."""
    plt = _pyplot()
    tl = build(events)
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(13, 7.5), sharex=True,
                                        gridspec_kw={"height_ratios": [3, max(1.2, 0.35 * tl.world_size), 0.8]})
    _progress(ax1, tl)
    _lanes(ax2, tl)
    _where_time_went(ax3, tl)
    ax1.set_title(title or "step progress per rank; shaded: recovery phases (detect orange, replace red, "
                  "regroup yellow, restore blue, redo brown)", fontsize=9, loc="left")
    ax3.set_xlim(0, max(tl.wall_s, 1e-3))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
