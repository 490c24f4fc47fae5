"""Ranges of user-given values that several settings share: timeouts, recovery strategies,
``HOST:PORT`` addresses. Pure checks for :mod:`unbroken.config` and :mod:`unbroken.worker_config`;
each raises a :class:`~unbroken.errors.ConfigError` naming the setting (flag, environment
variable or keyword) the value came from and what is allowed.
"""

from __future__ import annotations

import math

from unbroken.errors import ConfigError
from unbroken.names import RUNGS, Rung

#: Rungs this version can carry out.
IMPLEMENTED_RUNGS: tuple[Rung, ...] = RUNGS

#: The longest timeout any ``*_timeout_s`` setting takes: one day (a timedelta of 1e300 s
#: overflows in torch, ``inf`` never fires).
MAX_TIMEOUT_S = 86400.0


def require(ok: bool, message: str) -> None:
    """A ConfigError with ``message`` (what is wrong, what is allowed) unless ``ok``."""
    if not ok:
        raise ConfigError(message)


def require_timeout(value: float | None, name: str, *, optional: bool = False) -> None:
    """``value`` (the setting ``name``: a flag or an environment variable) is a finite number of
    seconds in (0, MAX_TIMEOUT_S]; ``None`` passes where ``optional``."""
    if value is None and optional:
        return
    if not (isinstance(value, (int, float)) and math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise ConfigError(f"{name} must be a number of seconds in (0, {MAX_TIMEOUT_S:.0f}] (finite, > 0), got {value}")


def require_strategy(name: str) -> None:
    """``name`` (one entry of ``--recover-strategy``) is a rung this version builds."""
    allowed = ", ".join(IMPLEMENTED_RUNGS)
    if name not in RUNGS:
        raise ConfigError(f"--recover-strategy: unknown strategy {name!r} (allowed: {allowed})")
    if name not in IMPLEMENTED_RUNGS:
        raise ConfigError(f"--recover-strategy: {name!r} is not built in this version (allowed: {allowed})")


def check_host_port(text: str, name: str) -> tuple[str, int]:
    """``text`` as HOST:PORT (port in 1..65535); a ConfigError naming ``name`` otherwise."""
    host, _, port = text.rpartition(":")
    if not (host and port.isdigit() and 1 <= int(port) <= 65535):
        raise ConfigError(f"{name}={text!r} must be HOST:PORT with a port in 1..65535 (e.g. 127.0.0.1:29400)")
    return host, int(port)
