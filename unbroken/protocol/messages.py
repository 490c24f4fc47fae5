"""The control-plane messages of unbroken, by direction: agent <-> controller, worker <->
controller. Each is a frozen dataclass registered under its wire `type` string; the schema
(how a message is declared, encoded, decoded and checked) is :mod:`unbroken.protocol.schema`,
whose names are re-exported here. Nothing is ever pickled.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from unbroken.errors import ProtocolError
from unbroken.protocol.schema import (  # noqa: F401  (re-exported: the protocol's one import)
    PROTOCOL_VERSION, Encoded, Message, decode, encode, message, message_types)


#: The most bytes one rank's encoded per-rank state may take (worker/rollback.py): it travels
#: in control-plane frames (at most MAX_FRAME_BYTES = 1 MiB), up to two of them in one order.
PER_RANK_LIMIT_BYTES = 256 * 1024
#: The most module names one SpareImports carries, and the longest name (a spare imports each).
MAX_SPARE_IMPORTS = 256
MAX_MODULE_NAME_CHARS = 200


def spare_import_names(names: Any) -> list[str]:
    """The valid names of ``names``, in order, without repeats, at most MAX_SPARE_IMPORTS: dotted
    Python identifiers (``torch.distributed.fsdp``) of at most MAX_MODULE_NAME_CHARS; anything else
    is dropped (what a spare imports must be a module name, nothing more)."""
    out: dict[str, None] = {}
    for name in names if isinstance(names, (list, tuple)) else ():
        if (isinstance(name, str) and len(name) <= MAX_MODULE_NAME_CHARS
                and all(part.isidentifier() for part in name.split("."))):
            out.setdefault(name)
            if len(out) == MAX_SPARE_IMPORTS:
                break
    return list(out)


# ---------------------------------------------------------------- the messages
# agent -> controller


@message("agent_register")
class AgentRegister(Message):
    node_rank: int
    nproc: int
    host: str
    pid: int
    standby: bool = False  # a spare agent: hosts no rank until the controller moves one there


@message("agent_event")
class AgentEvent(Message):
    """An agent's record for the job's event log (its spares: spare_ready, prerun_failed)."""

    name: str
    fields: dict[str, Any]


@message("rank_started")
class RankStarted(Message):
    rank: int
    pid: int
    attempt: int
    how: str = ""  # forked by a pool's zygote ("pool") or the node's ("zygote"), "spare", "prerun", "process"


@message("rank_exited")
class RankExited(Message):
    rank: int
    pid: int
    attempt: int
    exit_code: int | None
    signal: int | None
    last_lines: list[str]
    # the rank's own state as the reduction of step ``own_step`` began, from its file (checkpoint/own_state.py)
    own_step: int = -1
    own_state: bytes = b""


@message("rank_status")
class RankStatus(Message):
    """The agent saw a worker's process change state: running | stopped (SIGSTOP, a
    debugger) | zombie. Evidence for the hang monitor (controller/hangs.py)."""

    rank: int
    pid: int
    attempt: int
    status: str


@message("ranks_stopped")
class RanksStopped(Message):
    node_rank: int
    attempt: int


# controller -> agent


@message("start_ranks")
class StartRanks(Message):
    attempt: int
    store_host: str
    store_port: int
    world_size: int
    ranks: list[int] = dataclasses.field(default_factory=list)  # empty: this node's own ranks
    store_prefix: str = ""  # the attempt's secret rendezvous key prefix (controller/rendezvous.py)
    # After rung elastic shrank the job (controller/elastic.py), one entry per rank of ``ranks``:
    local_ranks: list[int] = dataclasses.field(default_factory=list)  # empty: rank - node_rank * nproc
    data_ranks: list[str] = dataclasses.field(default_factory=list)  # "0,2": the data-parallel ranks it runs
    restore_ranks: list[int] = dataclasses.field(default_factory=list)  # whose memory-tier snapshot it restores
    data_world_size: int = 0  # the data-parallel world the global batch is split into (0: world_size)
    lr_scale: float = 1.0  # --elastic-lr-scaling's factor (fast mode)
    # After a scale-out (controller/elastic.py), one entry per rank of ``ranks``: the agent and rank whose
    # snapshot the agent fetches for it from that agent's memory before starting it (-1: none).
    fetch_agents: list[int] = dataclasses.field(default_factory=list)
    fetch_ranks: list[int] = dataclasses.field(default_factory=list)


@message("peer_agents")
class PeerAgents(Message):
    """The address book of the peer copies (agent/peer_memory.py) and of the summary tree
    (agent/summary_tree.py): each connected agent's id, host and peer-memory port (0: it keeps none), the
    agents hosting ranks now (the ring), and the receiver's own id (a standby agent learns it here)."""

    you: int
    agents: list[int]
    hosts: list[str]
    ports: list[int]
    hosting: list[int]
    # Each agent's relay port for the tree of node summaries (setting node_summaries; agent/summary_tree.py),
    # 0: none; empty: no agent has one.
    relay_ports: list[int] = dataclasses.field(default_factory=list)


@message("stop_ranks")
class StopRanks(Message):
    attempt: int
    reason: str


@message("kill_rank")
class KillRank(Message):
    rank: int
    pid: int
    reason: str


@message("shutdown")
class Shutdown(Message):
    exit_code: int
    reason: str


# worker -> controller


@message("rank_register")
class RankRegister(Message):
    rank: int
    pid: int
    attempt: int
    gen: int = 0
    replacement: bool = False
    relay: bool = False  # step reports via its node's agent, commits back that way (agent/relay.py)


@message("progress")
class Progress(Message):
    rank: int
    attempt: int
    step: int
    phase: str
    metrics: dict[str, Any]
    state: bytes = b""  # with phase 'compute': the rank's own state at the step's start (worker/rollback.py)
    state_same: bool = False  # instead of `state`: the rank's own state is the one it last sent
    # With phase 'compute': this report is also the previous step's 'done' (the rank completed `step`
    # steps; `metrics` are that step's), folded in to save a message per step (worker/progress.py).
    done: bool = False
    # With a 'done': step `step` - 1 committed here without its commit report (worker/commit.py), which
    # this stands for; the rank's state after its compute is in node memory (checkpoint/own_state.py).
    synced: bool = False
    # With phase 'compute': the rank's own state at the start of `step` differs from its state after
    # computing `step` - 1 (it moved during the update or after the step's block: controller/rank_state.py).
    moved: bool = False


@message("heartbeat")
class Heartbeat(Message):
    rank: int


@message("claim_fault")
class ClaimFault(Message):
    rank: int
    fault_id: str


# controller -> worker, and replies in any direction


@message("fault_claim")
class FaultClaim(Message):
    fault_id: str
    granted: bool


@message("rank_event")
class RankEvent(Message):
    """A worker's record for the job's event log (restored, checkpoint_saved, ...)."""

    rank: int
    attempt: int
    name: str
    fields: dict[str, Any]


# in-flight recovery (worker <-> controller, controller -> agent)


@message("session_ready")
class SessionReady(Message):
    """The worker runs an unbroken step loop and committed a step; ``num_replicas`` 0 means full
    replication. ``not_in_flight``: why this rank's state cannot be recovered in flight ("": it can).
    ``mesh_names``/``mesh_sizes``: the job's mesh (``job.mesh``), empty for a flat data-parallel
    job; its replicas live along ``mesh_replicate`` (recovery/mesh_map.py)."""

    rank: int
    attempt: int
    num_replicas: int
    not_in_flight: str = ""
    mesh_names: list[str] = dataclasses.field(default_factory=list)
    mesh_sizes: list[int] = dataclasses.field(default_factory=list)
    mesh_replicate: str = ""
    not_exact: str = ""  # why this rank's script cannot keep its global batch on fewer ranks ("": it can)


@message("step_synced")
class StepSynced(Message):
    rank: int
    attempt: int
    gen: int
    step: int
    state: bytes = b""  # the rank's own state after the step's compute (a roll forward resumes from it)
    state_same: bool = False  # instead of `state`: the rank's own state is the one it last sent


@message("sync_state")
class SyncState(Message):
    """A rank's own state as its reduction of ``step`` begins, in a step that commits without a vote
    (worker/commit.py) on a node that keeps no file of it (checkpoint/own_state.py: another node's ranks): it
    stands for the state after compute, and the step's commit report is not sent. Sent before the rank
    enters the reduction (and by a relay at once, not in a batch), so it has left before any rank can update
    the step; a lost node's ranks then resume in flight from it (unless the node dies with it still on the
    wire: then the recovery refuses, and the job restarts, exact). Nothing else: not a phase, not a commit
    (Progress.synced says that)."""

    rank: int
    attempt: int
    gen: int
    step: int
    state: bytes = b""
    state_same: bool = False  # instead of `state`: the rank's own state is the one it last sent


@message("commit_step")
class CommitStep(Message):
    gen: int
    step: int


#: The worker messages an agent relays to the controller in a :class:`NodeReports` (its ranks' step reports).
RELAYED_TYPES = ("progress", "step_synced", "sync_state", "rank_paused")


@message("node_reports")
class NodeReports(Message):
    """An agent's batch of its ranks' step reports (agent/relay.py), in the order it got them:
    ``entries[i]`` is one encoded worker message of a type in :data:`RELAYED_TYPES`, from the
    process ``pids[i]`` (the controller fences on it). Decoded with the schema, never unpickled."""

    entries: list[Encoded]
    pids: list[int]
    # Seconds since the agent took each entry in (empty: just now): held reports (setting node_summaries)
    # go on late, and the controller times a rank's progress by when it reported (agent/held_reports.py).
    ages: list[float] = dataclasses.field(default_factory=list)


@message("node_summary")
class NodeSummary(Message):
    """A node's steady steps in one message (setting node_summaries; agent/held_reports.py): its ``nranks``
    ranks of ``attempt`` completed at least ``done`` steps, and each reported within the last ``age_s``
    seconds; their slowest step took ``step_s`` (``ckpt_s`` of it in the checkpoint); the median of their
    compute times' medians is ``compute_s``, the slowest is rank ``slow_rank``'s ``slow_s`` (-1: not yet
    ``WINDOW`` steps each)."""

    attempt: int
    nranks: int
    done: int
    age_s: float
    step_s: float
    ckpt_s: float
    compute_s: float
    slow_rank: int
    slow_s: float


@message("group_summary")
class GroupSummary(Message):
    """A group of nodes' summaries in one message, from the group's leader (agent/summary_tree.py): row ``i``
    is agent ``agents[i]``'s newest :class:`NodeSummary` (its fields as columns; ``age_s`` grown by how long
    the leader held it); ``step_s`` and ``ckpt_s`` are the group's slowest."""

    agents: list[int]
    attempts: list[int]
    nranks: list[int]
    done: list[int]
    age_s: list[float]
    step_s: float
    ckpt_s: float
    compute_s: list[float]
    slow_rank: list[int]
    slow_s: list[float]


@message("flush_reports")
class FlushReports(Message):
    """Controller -> agents: send the held step reports now (a rank was seen stopped: the hang rule needs
    every rank's place; agent/held_reports.py)."""


@message("stop_requested")
class StopRequested(Message):
    """The agent got ``signal`` (SIGTERM: a pod deleted or evicted, `scancel`): the job dumps its
    newest committed step to --save where it can, then stops (controller/terminate.py)."""

    node_rank: int
    signal: int


# controller -> worker


@message("abort")
class Abort(Message):
    """Leave generation ``gen - 1``: abort pending collectives, then pause for the regroup."""

    gen: int
    reason: str
    # The newest committed step when the order went out: a rank waiting for that step's commit,
    # which may still be on its way through the agent (agent/relay.py), takes it from here.
    committed_step: int = -1


@message("rank_paused")
class RankPaused(Message):
    rank: int
    attempt: int
    gen: int
    step: int
    phase: str
    # Cut inside a reduction after the step's update, which the script changes state after (a GAN's
    # second update, a scheduler stepped after a logging all-reduce): no exact roll forward.
    cut_in_tail: bool = False
    # Cut inside the reduction of a step committed without a vote (worker/commit.py): its gradients are not
    # whole; if a peer updated, it takes the updated state from one and its own state from the cut, unless
    # ``cut_unsure`` says why its state at the cut need not be its state after the step's compute.
    cut_in_reduction: bool = False
    cut_unsure: str = ""


@message("regroup")
class Regroup(Message):
    """Join generation ``gen`` and resume at ``resume_step``. A replaced rank's copy carries its own
    per-rank state for that step (``rank_state``, as the controller kept it); the replaced ranks
    in ``fallback`` have none there and take a survivor's copy instead."""

    gen: int
    resume_step: int
    replaced: list[int]
    rank_state: bytes = b""
    fallback: list[int] = dataclasses.field(default_factory=list)
    # Survivors cut inside the reduction of the step the job resumes after, which a peer updated: they
    # receive the replicated state as a replaced rank does, and keep their own state from the cut.
    behind: list[int] = dataclasses.field(default_factory=list)


@message("rank_resumed")
class RankResumed(Message):
    rank: int
    attempt: int
    gen: int
    step: int
    restore_s: float
    phases: dict[str, Any] = dataclasses.field(default_factory=dict)  # the restore_phases event's fields


@message("spare_imports")
class SpareImports(Message):
    """The modules the job's script imported (a worker reported them at ``unbroken.init()``):
    the agent's warm spares import them too, so a replacement pays no import (agent/spare.py).
    Names only, checked with :func:`spare_import_names` at each end."""

    modules: list[str]


@message("restart_rank")
class RestartRank(Message):
    rank: int
    attempt: int
    gen: int
    store_host: str = ""
    store_port: int = 0
    world_size: int = 0  # the job's (a standby agent does not know it from its own flags)
    store_prefix: str = ""
    data_ranks: str = ""  # after rung elastic: the data-parallel ranks it runs, "0,2" ("": its rank)
    data_world_size: int = 0  # after rung elastic: the data-parallel world (0: world_size)
    lr_scale: float = 1.0  # after rung elastic: --elastic-lr-scaling's factor


# the storage tier, written by agents from the memory tier


@message("persisted")
class Persisted(Message):
    """An agent wrote its ranks' files of ``step`` to storage (``error``: it failed)."""

    step: int
    ranks: list[int]
    seconds: float
    error: str = ""


@message("rank_damaged")
class RankDamaged(Message):
    """A worker's state was damaged (its process is fine): rung `retry` repairs it. ``kind``:
    "memory-fault", "non-finite" (loss/gradients) or "sdc" (differs from its replicas)."""

    rank: int
    attempt: int
    what: str
    kind: str = "memory-fault"


@message("dump")
class Dump(Message):
    """Rung `dump`: write the state at ``step`` to storage: this rank's file and those of the
    lost ranks in ``assign`` (pairs [lost rank, writer rank]) that name this rank."""

    gen: int
    step: int
    assign: list[list[int]]
    # the lost ranks' own per-rank states for ``step`` (rank as str -> encoded), those this rank writes
    states: dict[str, bytes] = dataclasses.field(default_factory=dict)


@message("dumped")
class Dumped(Message):
    rank: int
    attempt: int
    step: int
    ranks: list[int]
    error: str = ""


# restore at a job (re)start: the controller decides the step every rank loads


def _at_least(msg: Message, minimum: int, *names: str) -> None:
    """ProtocolError unless each named int field (or each item of a list[int] field) is >=
    ``minimum``. Values of the wrong type are left to the type check of encode/decode."""
    for name in names:
        value = getattr(msg, name)
        items = enumerate(value) if type(value) is list else [(None, value)]
        for i, item in items:
            if type(item) is int and item < minimum:
                where = "" if i is None else f" at [{i}]"
                raise ProtocolError(f"message {msg.TYPE!r}: field {name!r} must be >= {minimum}, got {item}{where}")


@message("restore_offer")
class RestoreOffer(Message):
    """The steps ``rank`` can load in round ``round`` of the restore: committed in its own
    node's shared memory (``peer_steps``: those of them fetched from a peer node's copy), and with
    its part committed in storage (newest first)."""

    rank: int
    attempt: int
    round: int
    memory_steps: list[int]
    storage_steps: list[int]
    peer_steps: list[int] = dataclasses.field(default_factory=list)  # of memory_steps: fetched from a peer's copy

    def __post_init__(self) -> None:
        _at_least(self, 0, "rank", "attempt", "round", "memory_steps", "storage_steps", "peer_steps")


@message("restore_at")
class RestoreAt(Message):
    """The controller's decision for round ``round``: every rank loads ``step`` (-1: no step
    is committed for every rank, the job starts fresh)."""

    attempt: int
    round: int
    step: int

    def __post_init__(self) -> None:
        _at_least(self, 0, "attempt", "round")
        _at_least(self, -1, "step")


@message("rank_degraded")
class RankDegraded(Message):
    """A rank reports itself degraded (sub-health): a health monitor, a user hook, an injected
    fault. Under ``--sub-health-policy grace-exit`` the job dumps its state and restarts."""

    rank: int
    attempt: int
    reason: str


# the rendezvous store, served by the controller on its own connection (role "store";
# controller/store_service.py, worker/store_client.py). Values are bytes, never unpickled.

#: What one attempt's store holds at most, and the most one request may carry. Frames are 1 MiB.
STORE_MAX_KEY_CHARS = 1024
STORE_MAX_VALUE_BYTES = 256 * 1024
STORE_MAX_KEYS = 65536  # per attempt
STORE_MAX_TOTAL_BYTES = 64 << 20  # per attempt, keys and values
STORE_MAX_KEYS_PER_REQUEST = 512
STORE_MAX_WAITS = 64  # blocked get/wait requests per connection
#: The operations (a torch ``Store``'s, less ``list_keys``: no client lists what others wrote).
STORE_OPS = ("set", "get", "add", "compare_set", "check", "wait", "delete_key", "num_keys", "append",
             "multi_get", "multi_set")


@message("store_request")
class StoreRequest(Message):
    """One store operation. ``keys``/``values`` by op: set, append: one of each; get, add,
    delete_key: one key; compare_set: one key, values [expected, desired]; check, wait,
    multi_get: the keys; multi_set: keys and values. ``amount``: add's increment.
    ``timeout_ms``: how long a get/wait/multi_get blocks for missing keys."""

    id: int
    op: str
    keys: list[str] = dataclasses.field(default_factory=list)
    values: list[bytes] = dataclasses.field(default_factory=list)
    amount: int = 0
    timeout_ms: int = 0

    def __post_init__(self) -> None:
        _at_least(self, 0, "id", "timeout_ms")


@message("store_reply")
class StoreReply(Message):
    """The answer to request ``id`` (-1: a request that could not be read). ``values``: what
    get/multi_get/compare_set return; ``number``: add's new value, check's and delete_key's
    0/1, num_keys. ``error`` (ok False): what was wrong, for the caller's exception."""

    id: int
    ok: bool
    values: list[bytes] = dataclasses.field(default_factory=list)
    number: int = 0
    error: str = ""
    timed_out: bool = False
