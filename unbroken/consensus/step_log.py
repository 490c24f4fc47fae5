"""The wired controller's commit log (``--controller-store``): one entry per step commit, and the
check that no two leaders acted at once.

A leading controller records every step it commits at the moment it commits it (the
``CommitStep`` action, under the controller's lock, after its term was checked): an entry in
its event log (``step_committed``) and, written by the durable mirror's thread in the same
guarded transaction as the state, a key in etcd::

    <job prefix>steps/<term>/<attempt>/<step>   ->  msgpack {"node", "gen", "t"}

The term is in the key, so two leaders never write the same key, and a new attempt that redoes
a step (a restart from the memory tier trains it again) writes a key of its own. Each write is
guarded by the writer's term, so etcd refuses the entries of a leader that lost its lease; the
event log keeps them (that is where a fenced leader that acted would show).

:func:`check` reads entries from both places and says what is wrong: a step committed twice in
one attempt, or a commit by a term at or after the moment a later term was won (``terms/<term>``
carries the winner's wall clock when it recorded its term) or after its own controller was
fenced. Wall clocks are compared, so the check is exact on one host (the tests' loopback and
network-namespace nodes) and off by the hosts' clock skew across machines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import msgpack

from unbroken.consensus.etcd import EtcdError

__all__ = ["CommitEntry", "check", "entries_from_events", "step_key", "steps_prefix"]


@dataclass(frozen=True)
class CommitEntry:
    term: int  # the leadership term of the controller that committed
    attempt: int
    gen: int
    step: int
    node: str = field(compare=False)  # the agent hosting that controller (a label: not compared)
    t: float  # unix seconds, the committing controller's clock, taken as it committed

    def encode(self) -> bytes:
        return msgpack.packb({"node": self.node, "gen": self.gen, "t": self.t})


def steps_prefix(prefix: bytes) -> bytes:
    return prefix + b"steps/"


def step_key(prefix: bytes, entry: CommitEntry) -> bytes:
    """Zero-padded, so key order is (term, attempt, step) order."""
    return steps_prefix(prefix) + b"%020d/%010d/%020d" % (entry.term, entry.attempt, entry.step)


def decode(prefix: bytes, key: bytes, value: bytes) -> CommitEntry:
    parts = key[len(steps_prefix(prefix)):].split(b"/")
    data = msgpack.unpackb(value, raw=False)
    if len(parts) != 3 or not all(p.isdigit() for p in parts) or not isinstance(data, dict):
        raise EtcdError(f"etcd key {key!r} is not a commit log entry (not written by unbroken?)")
    term, attempt, step = (int(p) for p in parts)
    return CommitEntry(term=term, attempt=attempt, gen=int(data.get("gen", -1)), step=step,
                       node=str(data.get("node", "")), t=float(data.get("t", 0.0)))


def entries_from_events(records: Iterable[Mapping[str, Any]], node: str) -> list[CommitEntry]:
    """The ``step_committed`` records of one agent's event log, as entries."""
    return [CommitEntry(term=int(r["term"]), attempt=int(r["attempt"]), gen=int(r["gen"]), step=int(r["step"]),
                        node=node, t=float(r["t"])) for r in records if r.get("event") == "step_committed"]


def check(entries: Iterable[CommitEntry], terms_won: Mapping[int, float],
          fenced_at: Mapping[int, float] = {}) -> list[str]:
    """What is wrong with a commit log (empty: nothing). ``entries`` may hold the same commit
    twice (from etcd and from an event log): equal entries (same term, attempt, step, clock) count once.
    ``terms_won``: term -> wall time its leader recorded it; ``fenced_at``: term -> wall time its
    controller was fenced (``controller_fenced``)."""
    problems: list[str] = []
    by_step: dict[tuple[int, int], list[CommitEntry]] = {}
    for e in sorted(set(entries), key=lambda e: (e.t, e.term, e.attempt, e.step)):
        by_step.setdefault((e.attempt, e.step), []).append(e)
        if e.term not in terms_won:
            problems.append(f"step {e.step} (attempt {e.attempt}) committed by term {e.term}, which no leader "
                            "recorded")
        later = [(t, won) for t, won in terms_won.items() if t > e.term and won <= e.t]
        if later:
            term, won = min(later)
            problems.append(f"step {e.step} (attempt {e.attempt}) committed by term {e.term} ({e.node}) at "
                            f"{e.t:.6f}, {e.t - won:.3f} s after term {term} was won: two leaders acted")
        if e.term in fenced_at and e.t >= fenced_at[e.term]:
            problems.append(f"step {e.step} (attempt {e.attempt}) committed by term {e.term} ({e.node}) "
                            f"{e.t - fenced_at[e.term]:.3f} s after its controller was fenced")
    for (attempt, step), found in sorted(by_step.items()):
        if len(found) > 1:
            problems.append(f"step {step} of attempt {attempt} committed {len(found)} times: "
                            + ", ".join(f"term {e.term} ({e.node}) at {e.t:.6f}" for e in found))
    return problems
