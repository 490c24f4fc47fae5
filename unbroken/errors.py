"""The library's exceptions: one base class, typed subclasses a caller can catch.

Every message names what failed, the values involved (rank, step, path, setting) and,
where there is one, the setting that controls it or what to do next.

Also the exit code :data:`EXIT_FATAL`: a worker exiting with it is never restarted.
"""

# A worker process exiting with this code says "fatal: do not restart me": the controller
# fails the job at once instead of taking the recovery ladder (a deterministic error would
# only fail again). Distinct from 1 and 2 (scripts, argparse), the sysexits range 64-78,
# the shell's 126/127 and 128 + signal. The library exits with it for a FatalError under
# `unbroken run`; a script may too: ``sys.exit(unbroken.EXIT_FATAL)``.
EXIT_FATAL = 97


class UnbrokenError(Exception):
    """Base class of every error raised by unbroken."""


class FatalError(UnbrokenError):
    """An error no restart can fix (bad configuration, state that cannot fit).

    Under `unbroken run`, one leaving ``unbroken.init()``, ``job.track()``, ``job.steps()``
    or a ``with job.step():`` block is logged and ends the worker with :data:`EXIT_FATAL`,
    so the job fails at once instead of restarting. Elsewhere it propagates as raised.
    """


class ConfigError(FatalError, ValueError):
    """A flag, config value or environment variable is invalid (usage error, exit code 2)."""


class ProtocolError(UnbrokenError):
    """A control-plane peer sent a malformed, oversized or unknown message."""


class AuthError(ProtocolError):
    """A control-plane peer failed authentication with the job secret."""


class ConnectionClosed(ProtocolError):
    """The control-plane peer closed the connection."""


class CheckpointError(UnbrokenError):
    """A checkpoint could not be written or read."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint file is missing, truncated, foreign or fails its checksum."""


class NoCheckpoint(CheckpointError):
    """No complete checkpoint exists where one was asked for."""


class ShmCapacityError(FatalError):
    """The memory tier's slots of this node's ranks would not fit in the shared-memory
    directory with headroom (checked before the first step; see ``unbroken.checkpoint.capacity``)."""


class InjectedFault(UnbrokenError):
    """Raised by fault injection (`raise:` faults); never raised in normal operation."""


class JobFailed(UnbrokenError):
    """The job ended without success (restart budget spent, or no recovery possible)."""


class OptimizerError(UnbrokenError):
    """The sharded optimizer was set up or used in a way it cannot honour (layout, replicas,
    parameters changed after construction, a state dict from another layout)."""


class CollectiveAborted(UnbrokenError):
    """A collective was abandoned because the caller's abort check returned True.

    The pending work objects are kept referenced by their owner (``abandoned_work``) until
    they end on their own at the process-group timeout; gloo cannot cancel them.
    """


class NoLiveReplica(UnbrokenError):
    """Every rank holding some piece of training state is gone: in-flight recovery of that
    piece is impossible and only a checkpoint can restore it.

    ``piece`` names the piece, ``holders`` all ranks that held it, ``dead`` those not alive.
    """

    def __init__(self, message: str, *, piece: object = None, holders: tuple[int, ...] = (),
                 dead: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.piece = piece
        self.holders = holders
        self.dead = dead


class StateDamaged(UnbrokenError):
    """This rank's training state (or the step in flight) is damaged while its process is fine:
    rung `retry` brings the state back from replicas and every rank redoes the step.

    ``kind`` says how it was found: "memory-fault", "non-finite" or "sdc".
    """

    kind = "memory-fault"


class DeviceMemoryError(StateDamaged):
    """A device-memory fault damaged tensors of this rank (an HBM/ECC uncorrectable error, or an
    injected one); the process is still usable and the damaged state can come from replicas."""

    kind = "memory-fault"


class NonFiniteError(StateDamaged):
    """The loss or the gradients of the step in flight are NaN or infinite on this rank (the
    seeds' "TRE"): the step is redone from its start on every rank."""

    kind = "non-finite"


class SilentCorruption(StateDamaged):
    """The cross-replica check found this rank's state different from the majority of its
    replicas (silent data corruption): the odd copy is replaced from the majority."""

    kind = "sdc"
