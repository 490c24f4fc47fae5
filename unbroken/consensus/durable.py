"""The controller's durable state in etcd: what a new leader needs to carry the job on.

Keys, all under the job's prefix ``/unbroken/<run id>/`` (:func:`job_prefix`; the run id is an
HMAC of the job secret, so the secret itself is never written):

* ``leader``  -- the leading controller (see :mod:`unbroken.consensus.election`);
* ``state``   -- a :class:`DurableState` (msgpack; nothing pickled), written when something besides
  the committed step changes (a start, a restart, a regroup onto another node): O(ranks) bytes;
* ``state/step`` -- the newest committed step, written at each commit (a few bytes), in the same
  transaction as ``state`` when both change; :meth:`DurableStore.load` reads the two in one range;
* ``terms/<term>`` -- one record per leadership won (node, address, the winner's wall clock when
  it recorded it), for audits and tests;
* ``steps/<term>/<attempt>/<step>`` -- the wired controller's commit log
  (:mod:`unbroken.consensus.step_log`), written with the state by :meth:`DurableStore.save`; a
  (term, attempt) keeps its newest :data:`STEP_LOG_KEEP` entries (the controllers' event logs keep
  every one), so a long job's keys stay bounded;
* ``commits/<step>`` -- a once-only commit (:meth:`DurableStore.commit`): one key per committed
  step, created only if absent, in the same transaction that moves ``state/step``. The
  consensus tests' candidates and the benchmark's ``leader_*`` rows use it; the wired controller
  does not (a new attempt redoes steps: it keeps ``steps/`` instead).

What etcd keeps of older revisions grows with every write until it is compacted: run etcd with
``--auto-compaction-mode=revision --auto-compaction-retention=10000`` (or a periodic retention), as
docs/controller-failover.md says; the writes here are a few hundred bytes per step.

Every write is one transaction guarded by the writer's :class:`~unbroken.consensus.election.Term`
(the leader key's create_revision must equal the term): a fenced leader's write is refused by
etcd (:class:`~unbroken.consensus.election.Fenced`). :class:`DurableStore` holds no state of its
own besides the client and the prefix; it is safe to share between threads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import msgpack

from unbroken.checkpoint.launch_dirs import run_id
from unbroken.consensus.election import Fenced, Term, leader_key
from unbroken.consensus.etcd import Compare, DeleteRange, EtcdClient, EtcdError, Put, prefix_end
from unbroken.consensus.step_log import CommitEntry, decode, step_key, steps_prefix
from unbroken.errors import ConfigError, UnbrokenError

__all__ = ["CommitRecord", "DurableState", "DurableStore", "StepAlreadyCommitted", "job_prefix"]


class StepAlreadyCommitted(UnbrokenError):
    """The commit log already holds this step (written by an earlier term)."""


def job_prefix(secret: str, job_id: str) -> bytes:
    """The etcd prefix of one job: derived from the secret by an HMAC, never the secret."""
    rid = run_id(secret, job_id)
    if rid is None:
        raise ConfigError("a controller store in etcd needs the job secret (UNBROKEN_SECRET): "
                          "the job's keys are named by an HMAC of it")
    return f"/unbroken/{rid}/".encode()


@dataclass(frozen=True)
class DurableState:
    """The job's bookkeeping a new leader must not lose.

    ``replica_map``: rank -> the ranks holding an identical copy of its state;
    ``rank_state_at``: rank -> the agent (node name) whose memory holds that rank's own state.
    """
    attempt: int = 0
    generation: int = 0
    committed_step: int = -1  # -1: nothing committed yet
    restart_budget: int = 0  # restarts left
    replica_map: dict[int, tuple[int, ...]] = field(default_factory=dict)
    rank_state_at: dict[int, str] = field(default_factory=dict)
    # what the replica map is made of, so a new leader rebuilds the same one
    num_replicas: int = 0
    mesh: tuple[tuple[str, int], ...] = ()
    mesh_replicate: str = ""
    finished: bool = False  # the job ended: a seat that wins afterwards starts no controller

    def encode(self) -> bytes:
        """msgpack, O(ranks): each distinct holder set and agent name once, then an index per rank
        (a fully replicated job's map as N tuples of N would be 2.8 MB at 1,024 ranks, over etcd's
        request limit)."""
        groups, group_of = _indexed(self.replica_map)
        agents, agent_of = _indexed(self.rank_state_at)
        return msgpack.packb({
            "attempt": self.attempt, "generation": self.generation, "committed_step": self.committed_step,
            "restart_budget": self.restart_budget, "replica_groups": [list(g) for g in groups],
            "replica_group_of": group_of, "agents": agents, "agent_of": agent_of,
            "num_replicas": self.num_replicas, "mesh": [list(dim) for dim in self.mesh],
            "mesh_replicate": self.mesh_replicate, "finished": self.finished})

    @classmethod
    def decode(cls, raw: bytes) -> DurableState:
        """Also the form written before 2026-12-06 (``replica_map``/``rank_state_at`` by rank)."""
        try:
            data = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except (ValueError, msgpack.UnpackException) as exc:
            raise EtcdError(f"the durable state in etcd is not msgpack (not written by unbroken?): {exc}") from None
        if not isinstance(data, dict):
            raise EtcdError("the durable state in etcd is not a map (not written by unbroken?)")
        ints = ("attempt", "generation", "committed_step", "restart_budget")
        if any(not isinstance(data.get(name), int) for name in ints):
            raise EtcdError(f"the durable state in etcd lacks one of {ints}: {sorted(data)}")
        try:
            if "replica_groups" in data:
                groups = [tuple(int(x) for x in g) for g in data["replica_groups"]]
                replica_map = {int(r): groups[i] for r, i in data.get("replica_group_of", {}).items()}
                agents = [str(a) for a in data.get("agents", [])]
                rank_state_at = {int(r): agents[i] for r, i in data.get("agent_of", {}).items()}
            else:
                replica_map = {int(r): tuple(int(x) for x in h) for r, h in data.get("replica_map", {}).items()}
                rank_state_at = {int(r): str(n) for r, n in data.get("rank_state_at", {}).items()}
            return cls(**{name: data[name] for name in ints}, replica_map=replica_map, rank_state_at=rank_state_at,
                       num_replicas=int(data.get("num_replicas", 0)),
                       mesh=tuple((str(name), int(size)) for name, size in data.get("mesh", [])),
                       mesh_replicate=str(data.get("mesh_replicate", "")),
                       finished=bool(data.get("finished", False)))
        except (TypeError, ValueError, IndexError, AttributeError) as exc:
            raise EtcdError(f"the durable state in etcd does not decode (not written by unbroken?): "
                            f"{type(exc).__name__}: {exc}") from None


def _indexed(by_rank: dict[int, Any]) -> tuple[list, dict[int, int]]:
    """(the distinct values, in first-seen order; rank -> the index of its value)."""
    values: list = []
    index: dict[Any, int] = {}
    out = {}
    for rank, value in by_rank.items():
        if value not in index:
            index[value] = len(values)
            values.append(value)
        out[rank] = index[value]
    return values, out


def _step_value(step: int) -> bytes:
    return msgpack.packb({"step": step})


def _decode_step(raw: bytes) -> int:
    try:
        data = msgpack.unpackb(raw, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise EtcdError(f"the committed step in etcd is not msgpack (not written by unbroken?): {exc}") from None
    if not isinstance(data, dict) or type(data.get("step")) is not int:
        raise EtcdError(f"the committed step in etcd is not {{'step': int}}: {data!r:.80}")
    return data["step"]


@dataclass(frozen=True)
class CommitRecord:
    step: int
    term: int  # the leadership term that committed it
    node: str
    revision: int  # etcd revision of the commit (its key's create_revision)


#: Puts per transaction (etcd refuses more than --max-txn-ops, 128 by default).
MAX_TXN_PUTS = 100
#: Commit log entries kept per (term, attempt): older ones are deleted as it grows.
STEP_LOG_KEEP = 10_000


def _step_key(prefix: bytes, step: int) -> bytes:
    return prefix + b"commits/%020d" % step  # zero-padded: key order is step order


class DurableStore:
    """Reads and guarded writes of one job's durable state (see the module docstring)."""

    def __init__(self, client: EtcdClient, prefix: bytes) -> None:
        self.client, self.prefix = client, prefix
        self.state_key = prefix + b"state"
        self.step_key = prefix + b"state/step"

    def load(self) -> DurableState | None:
        """The state with its newest committed step (``state`` and ``state/step``, read at once)."""
        found = {kv.key: kv.value for kv in self.client.range(self.state_key, prefix_end(self.state_key))}
        if not found.keys() & {self.state_key, self.step_key}:
            return None
        state = DurableState.decode(found[self.state_key]) if self.state_key in found else DurableState()
        if self.step_key in found:
            state = replace(state, committed_step=_decode_step(found[self.step_key]))  # written with or after it
        return state

    def record_term(self, term: Term, address: str) -> None:
        """Write ``terms/<term>`` (right after winning): the leadership history. Its ``t`` (this
        host's wall clock, read after the win) is when the term began at the latest."""
        record = {"node": term.node, "address": address, "t": time.time()}
        self._guarded(term, [Put(self.prefix + b"terms/%020d" % term.revision, msgpack.packb(record))],
                      "record its term")

    def terms(self) -> dict[int, str]:
        """term -> node, for every leadership recorded."""
        out = {}
        for kv in self.client.get_prefix(self.prefix + b"terms/"):
            out[int(kv.key.rsplit(b"/", 1)[1])] = str(msgpack.unpackb(kv.value, raw=False)["node"])
        return out

    def terms_won(self) -> dict[int, float]:
        """term -> the wall time its leader recorded it (0.0 for a record without one)."""
        return {int(kv.key.rsplit(b"/", 1)[1]): float(msgpack.unpackb(kv.value, raw=False).get("t", 0.0))
                for kv in self.client.get_prefix(self.prefix + b"terms/")}

    def save(self, term: Term, state: DurableState | None, steps: Sequence[CommitEntry] = (), *,
             committed_step: int | None = None) -> None:
        """Replace the state (attempt, generation, maps, budget, its committed step) if given, else
        only the committed step if given (a steady commit changes nothing else), and append
        ``steps`` to the commit log, each (term, attempt) cut to its newest :data:`STEP_LOG_KEEP`
        entries; in as few transactions as etcd takes (the state and its step in the first), each
        guarded; Fenced if ``term`` is over."""
        ops: list[Put | DeleteRange] = []
        if state is not None:
            ops += [Put(self.state_key, state.encode()), Put(self.step_key, _step_value(state.committed_step))]
        elif committed_step is not None:
            ops.append(Put(self.step_key, _step_value(committed_step)))
        ops += [Put(step_key(self.prefix, e), e.encode()) for e in steps]
        newest: dict[tuple[int, int], int] = {}
        for e in steps:
            newest[(e.term, e.attempt)] = max(e.step, newest.get((e.term, e.attempt), -1))
        for (t, attempt), step in sorted(newest.items()):
            if step >= STEP_LOG_KEEP:
                first = step_key(self.prefix, CommitEntry(term=t, attempt=attempt, gen=0, step=0, node="", t=0.0))
                keep = step_key(self.prefix, CommitEntry(term=t, attempt=attempt, gen=0, step=step - STEP_LOG_KEEP + 1,
                                                         node="", t=0.0))
                ops.append(DeleteRange(first, keep))
        for start in range(0, len(ops), MAX_TXN_PUTS):
            self._guarded(term, ops[start:start + MAX_TXN_PUTS], "save the job state")

    def step_log(self) -> list[CommitEntry]:
        """The wired controller's commit log (``steps/``), in (term, attempt, step) order."""
        return [decode(self.prefix, kv.key, kv.value) for kv in self.client.get_prefix(steps_prefix(self.prefix))]

    def commit(self, term: Term, step: int, state: DurableState) -> DurableState:
        """Commit ``step``: the log entry and ``state.committed_step = step`` in one transaction.
        Fenced if ``term`` is over; StepAlreadyCommitted if the log holds ``step`` from another
        term. A retry of our own commit (an answer lost in flight) is taken as done."""
        if step <= state.committed_step:
            raise StepAlreadyCommitted(f"step {step} is not after the committed step {state.committed_step}")
        term.check()
        new = replace(state, committed_step=step)
        key = _step_key(self.prefix, step)
        entry = msgpack.packb({"term": term.revision, "node": term.node})
        result = self.client.txn([term.guard(), Compare(key, "CREATE", 0)],
                                 [Put(key, entry), Put(self.step_key, _step_value(step))],
                                 failure_reads=[leader_key(self.prefix), key])
        if result.succeeded:
            return new
        found = {kv.key: kv for kv in result.kvs}
        held = found.get(term.key)
        if held is None or held.create_revision != term.revision:
            term.lost.set()
            raise Fenced(f"controller {term.node!r} (term {term.revision}): commit of step {step} refused, "
                         "another controller leads now")
        mine = msgpack.unpackb(found[key].value, raw=False) if key in found else {}
        if mine.get("term") == term.revision:
            return new
        raise StepAlreadyCommitted(f"step {step} was already committed by term {mine.get('term')} "
                                   f"({mine.get('node')!r}); this is term {term.revision}")

    def commits(self) -> list[CommitRecord]:
        """The commit log, in step order."""
        out = []
        for kv in self.client.get_prefix(self.prefix + b"commits/"):
            entry: dict[str, Any] = msgpack.unpackb(kv.value, raw=False)
            out.append(CommitRecord(step=int(kv.key.rsplit(b"/", 1)[1]), term=int(entry["term"]),
                                    node=str(entry["node"]), revision=kv.create_revision))
        return out

    def _guarded(self, term: Term, puts: Sequence[Put | DeleteRange], what: str) -> None:
        term.check()
        if not self.client.txn([term.guard()], puts).succeeded:
            term.lost.set()
            raise Fenced(f"controller {term.node!r} (term {term.revision}) could not {what}: "
                         "another controller leads now, or its lease expired")
