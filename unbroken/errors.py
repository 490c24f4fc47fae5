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
