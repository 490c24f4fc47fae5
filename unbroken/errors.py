"""The library's exceptions: one base class, typed subclasses a caller can catch.

Every message names what failed, the values involved (rank, step, path, setting) and,
where there is one, the setting that controls it or what to do next.
"""


class UnbrokenError(Exception):
    """Base class of every error raised by unbroken."""


class ConfigError(UnbrokenError, ValueError):
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


class DeviceMemoryError(UnbrokenError):
    """A device-memory fault damaged tensors of this rank (an HBM/ECC uncorrectable error, or an
    injected one); the process is still usable and the damaged state can come from replicas."""
