"""The fault-injection plan language: what `--inject` says, parsed into `Fault` values.

A plan is a comma-separated list of faults, each `KIND:key=value:key=value`, e.g.

    kill:rank=2:step=30,hang:rank=1:step=60,raise:rank=0:step=90:at=update

Kinds and what the injector does when one fires (the injector lives elsewhere; this module
is pure text <-> values and imports no torch):

    kill       SIGKILL the worker process
    hang       the worker stops making progress
    raise      raise `InjectedFault` inside the training step
    exit       `sys.exit(code)`; key `code=N` (0..255, default 1)
    corrupt    damage a tensor in memory; key `what=params|optimizer|grads` (default params)
    flip       flip one bit of a tensor silently (no error: silent data corruption, found by
               the cross-replica check); key `what=params|optimizer|grads` (default params)
    nan        the loss of the step turns NaN (the tracked model's outputs), so do its gradients
    subhealth  the rank reports itself degraded (as a device health monitor would)

Keys of every kind: `rank` (int >= 0, required), `step` (int >= 0, required) and `at`, the
phase of the step in which the fault fires: `compute` (default), `sync`, `update`,
`checkpoint`, `restore` (in a replacement process while it receives its state). Faults that name the same rank, step and phase fire in plan order.

Every `Fault` is canonical: defaults are left out of its text and its `params`, so
`exit:rank=0:step=5:code=1` and `exit:rank=0:step=5` are the same fault with the same
`fault_id`, and a plan naming both is rejected as a duplicate.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass

from unbroken.names import FAULT_PHASES
from unbroken.errors import ConfigError

__all__ = [
    "CORRUPT_TARGETS",
    "FAULT_PHASES",
    "Fault",
    "FaultKind",
    "format_plan",
    "parse_plan",
    "validate_plan",
]

# Phases of a training step in which a fault can fire (unbroken.names); the first is the default.
DEFAULT_PHASE = FAULT_PHASES[0]

# What a `corrupt` fault may damage; the first is the default.
CORRUPT_TARGETS: tuple[str, ...] = ("params", "optimizer", "grads")

# Exit codes a process can actually report (POSIX keeps the low 8 bits).
_MAX_EXIT_CODE = 255
_DEFAULT_EXIT_CODE = "1"

# ASCII digits only: int() would also accept "+3", " 3", "3_0" and non-ASCII digits, none
# of which round-trip through the canonical text.
_INTEGER = re.compile(r"-?[0-9]+")


class FaultKind(enum.Enum):
    """What happens to the worker when a fault fires."""

    KILL = "kill"
    HANG = "hang"
    RAISE = "raise"
    EXIT = "exit"
    CORRUPT = "corrupt"
    NAN = "nan"
    SUBHEALTH = "subhealth"
    FLIP = "flip"

    @property
    def extra_keys(self) -> tuple[str, ...]:
        """Keys this kind accepts besides rank, step and at."""
        if self is FaultKind.EXIT:
            return ("code",)
        if self in (FaultKind.CORRUPT, FaultKind.FLIP):
            return ("what",)
        return ()


_ALLOWED_KINDS = ", ".join(kind.value for kind in FaultKind)
_COMMON_KEYS = ("rank", "step", "at")


@dataclass(frozen=True)
class Fault:
    """One planned fault: `kind` fires on `rank` at step `step`, in phase `at`.

    `params` holds the kind's extra keys as sorted (key, value) text pairs, defaults left
    out (see the module docstring); construction normalizes and validates them, so a Fault
    built in code equals the one parsed from its text. Invalid values raise ConfigError.
    """

    kind: FaultKind
    rank: int
    step: int
    at: str = DEFAULT_PHASE
    params: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.kind, FaultKind):
            raise ConfigError(f"fault kind must be a FaultKind, got {self.kind!r}")
        for name in ("rank", "step"):
            value = getattr(self, name)
            # bool is an int subclass; rank=True is a bug, not rank 1.
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{self.kind.value}: '{name}' must be an integer >= 0, got {value!r}")
        if self.at not in FAULT_PHASES:
            raise ConfigError(_bad_phase(self.at))
        object.__setattr__(self, "params", _normalize_params(self.kind, self.params))

    @property
    def fault_id(self) -> str:
        """Stable identity of this fault within a plan: its canonical text."""
        return str(self)

    @property
    def exit_code(self) -> int:
        """The exit status an `exit` fault ends the worker with."""
        return int(dict(self.params).get("code", _DEFAULT_EXIT_CODE))

    @property
    def corrupt_target(self) -> str:
        """What a `corrupt` or `flip` fault damages: one of CORRUPT_TARGETS."""
        return dict(self.params).get("what", CORRUPT_TARGETS[0])

    def __str__(self) -> str:
        parts = [self.kind.value, f"rank={self.rank}", f"step={self.step}"]
        if self.at != DEFAULT_PHASE:
            parts.append(f"at={self.at}")
        parts.extend(f"{key}={value}" for key, value in self.params)
        return ":".join(parts)


def parse_plan(text: str, *, source: str = "--inject") -> tuple[Fault, ...]:
    """Parse a plan; an empty or blank text is the empty plan.

    `source` names where the text came from (a flag or config key) in error messages.
    Raises ConfigError naming the bad item, the problem and what is allowed.
    """
    if not text.strip():
        return ()
    faults: list[Fault] = []
    seen: set[str] = set()
    for raw_item in text.split(","):
        item = raw_item.strip()
        try:
            fault = _parse_fault(item)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {item!r}: {exc}") from None
        if fault.fault_id in seen:
            raise ConfigError(
                f"{source}: {item!r}: duplicate fault: {fault.fault_id} appears twice in the plan "
                "(each fault fires once; remove one)"
            )
        seen.add(fault.fault_id)
        faults.append(fault)
    return tuple(faults)


def validate_plan(faults: Iterable[Fault], world_size: int, *, source: str = "--inject") -> None:
    """Check a parsed plan against the job: every fault must name an existing rank."""
    if world_size < 1:
        raise ConfigError(f"{source}: world size must be >= 1 to check the plan, got {world_size}")
    for fault in faults:
        if fault.rank >= world_size:
            raise ConfigError(
                f"{source}: {fault.fault_id!r}: rank {fault.rank} does not exist in a job of "
                f"world size {world_size} (allowed ranks: 0..{world_size - 1})"
            )


def format_plan(faults: Iterable[Fault]) -> str:
    """The canonical text of a plan; `parse_plan(format_plan(p)) == p`."""
    return ",".join(str(fault) for fault in faults)


def _parse_fault(item: str) -> Fault:
    """One `KIND:key=value...` item -> Fault; ConfigError messages omit the item itself."""
    if not item:
        raise ConfigError(
            "empty fault (two commas in a row, or a trailing comma?); "
            "expected KIND:rank=R:step=S, e.g. kill:rank=0:step=10"
        )
    kind_text, *fields = item.split(":")
    kind = _parse_kind(kind_text.strip())
    values: dict[str, str] = {}
    for field in fields:
        key, sep, value = field.partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            raise ConfigError(f"{field!r} is not key=value (allowed keys: {_allowed_keys(kind)})")
        _check_key(kind, key)
        if key in values:
            raise ConfigError(f"key '{key}' given twice")
        values[key] = value
    for key in ("rank", "step"):
        if key not in values:
            raise ConfigError(f"missing '{key}' (every fault needs rank=R and step=S, integers >= 0)")
    rank = _parse_count("rank", values.pop("rank"))
    step = _parse_count("step", values.pop("step"))
    at = values.pop("at", DEFAULT_PHASE)
    if at not in FAULT_PHASES:
        raise ConfigError(_bad_phase(at))
    return Fault(kind=kind, rank=rank, step=step, at=at, params=tuple(values.items()))


def _parse_kind(text: str) -> FaultKind:
    try:
        return FaultKind(text)
    except ValueError:
        raise ConfigError(f"unknown fault kind {text!r} (allowed: {_ALLOWED_KINDS})") from None


def _check_key(kind: FaultKind, key: str) -> None:
    if key in _COMMON_KEYS or key in kind.extra_keys:
        return
    owners = [k.value for k in FaultKind if key in k.extra_keys]
    if owners:
        raise ConfigError(
            f"key '{key}' is only allowed on {' and '.join(owners)} faults, not on {kind.value} "
            f"(allowed keys: {_allowed_keys(kind)})"
        )
    raise ConfigError(f"unknown key {key!r} (allowed keys: {_allowed_keys(kind)})")


def _allowed_keys(kind: FaultKind) -> str:
    return ", ".join(_COMMON_KEYS + kind.extra_keys)


def _parse_count(key: str, text: str) -> int:
    """A non-negative integer written in plain ASCII digits."""
    if not _INTEGER.fullmatch(text):
        raise ConfigError(f"'{key}' must be an integer >= 0, got {text!r}")
    value = int(text)
    if value < 0:
        raise ConfigError(f"'{key}' must be an integer >= 0, got {value}")
    return value


def _bad_phase(at: object) -> str:
    return f"unknown phase at={at!r} (allowed: {', '.join(FAULT_PHASES)}; default {DEFAULT_PHASE})"


def _normalize_params(kind: FaultKind, params: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """Validate a kind's extra keys; return them canonical: sorted, defaults dropped."""
    normalized: dict[str, str] = {}
    for pair in params:
        if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise ConfigError(f"{kind.value}: params must be (key, value) pairs of strings, got {pair!r}")
        key, value = pair
        _check_key(kind, key)
        if key in _COMMON_KEYS:
            raise ConfigError(f"{kind.value}: '{key}' is a field of Fault, not a param")
        if key in normalized:
            raise ConfigError(f"key '{key}' given twice")
        normalized[key] = _normalize_value(key, value)
    defaults = {"code": _DEFAULT_EXIT_CODE, "what": CORRUPT_TARGETS[0]}
    return tuple(
        (key, value) for key, value in sorted(normalized.items()) if value != defaults[key]
    )


def _normalize_value(key: str, value: str) -> str:
    if key == "code":
        code = _parse_count("code", value)
        if code > _MAX_EXIT_CODE:
            raise ConfigError(f"'code' must be an exit status 0..{_MAX_EXIT_CODE}, got {code}")
        return str(code)  # "007" and "7" are the same fault
    if value not in CORRUPT_TARGETS:
        raise ConfigError(f"unknown what={value!r} (allowed: {', '.join(CORRUPT_TARGETS)})")
    return value
