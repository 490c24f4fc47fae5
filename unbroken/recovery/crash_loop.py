"""The crash-loop rule: the same failure again and again is a bug in the script, not a fault of
the machine, and restarting cannot help. Pure policy, no processes (the controller's state machine
asks it about each failed rank; ``--crash-loop-limit`` is the bound)."""

from __future__ import annotations

import re
from typing import Protocol, Sequence


class FailureLike(Protocol):
    """What the rule reads of a failure (:class:`unbroken.controller.api.Failure`)."""

    attempt: int
    gen: int
    kind: str
    exit_code: int | None
    signal: int | None
    step: int | None
    last_lines: tuple[str, ...]


def repeats(failures: Sequence[FailureLike]) -> int:
    """In how many episodes in a row (an attempt's generation: one fault and its recovery) the
    newest failure was seen: the same kind, exit status, step and last output line, on any rank (a
    deterministic error in the script fails every rank alike, whichever the ladder saw first), the
    numbers in the line aside (a rank, a pid). Several ranks failing in one episode count once; an
    episode that saw only a hang-kill neither counts nor breaks the run (a rank slow to exit after
    the error, under load, is killed as hung while its peer's error went unseen)."""
    def key(f: FailureLike) -> tuple:
        line = re.sub(r"\d+", "#", f.last_lines[-1].strip()) if f.last_lines else ""
        return f.kind, f.exit_code, f.signal, f.step, line

    last = failures[-1]
    if last.kind not in ("exit", "crash"):
        return 0
    seen: dict[tuple[int, int], bool | None] = {}  # episode -> seen in it (None: hangs only); newest first
    for f in reversed(failures):
        episode = (f.attempt, f.gen)
        if f.kind == "hang":
            seen.setdefault(episode, None)
        else:
            seen[episode] = bool(seen.get(episode)) or key(f) == key(last)
    count = 0
    for matched in seen.values():
        if matched is False:
            break
        count += matched is True
    return count
