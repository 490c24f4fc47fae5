"""The schema of control-plane messages: frozen dataclasses registered under a wire `type` string.

A message class is declared once and is then both the Python noun the controller, agents
and workers pass around and its wire schema::

    @message("progress")
    class Progress(Message):
        rank: int
        step: int

`encode(msg)` turns a message into a plain dict (msgpack-able, with a "type" key) and
`decode(obj)` turns such a dict back into the message, checking it strictly: a known
type, every required field, no unknown field, each value of its annotated type. Anything
else is a `ProtocolError` that names the message type, the field, what was expected and
what came. Nothing here is ever pickled.

Supported field annotations: int, float (an int is accepted and converted), str, bool,
bytes, Any (any msgpack-able value), Encoded (an encoded message that its receiver decodes),
`X | None`, `list[X]` and `dict[str, X]` of those.
bool is never accepted where int or float is expected. A field with a default is optional
on the wire, which is how a field is added without breaking older peers.

Adding a message: declare a dataclass with `@message("snake_case_name")` (in
:mod:`unbroken.protocol.messages`, where the protocol's messages are, or in any module
imported by both ends); unsupported annotations fail at import time with TypeError.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, TypeVar, Union

from unbroken.errors import ProtocolError

PROTOCOL_VERSION = 1

# Frame types of the connection handshake (see wire.py); no message may take these names.
_RESERVED_TYPES = frozenset({"challenge", "hello", "welcome", "reject"})
_MAX_NESTING = 32  # deeper values in an Any field are refused, not recursed into
_ABSENT = object()  # a field not on the wire
Converter = Callable[[Any, int], Any]  # (value, nesting depth) -> the checked value; see _converter


class Message:
    """Base class of every control message; `TYPE` is its wire name, set by `@message`."""

    TYPE: ClassVar[str] = ""


class Encoded:
    """Field annotation: an encoded message (a map), carried inside another one (NodeReports).
    Only its being a map is checked here: its receiver decodes it, which checks all of it, so a
    batch is not walked twice (the frame's nesting is bounded by framing.py already)."""


M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class _Field:
    name: str
    annotation: Any
    expected: str  # the annotation as written in error messages, e.g. "list[str]"
    convert: Converter = dataclasses.field(compare=False, repr=False)
    default: Callable[[], Any] | None = dataclasses.field(default=None, compare=False, repr=False)  # None: required

    @property
    def required(self) -> bool:
        return self.default is None


@dataclass(frozen=True)
class _Spec:
    cls: type[Message]
    fields: tuple[_Field, ...]

    @functools.cached_property
    def optional(self) -> tuple[_Field, ...]:
        return tuple(f for f in self.fields if not f.required)

    def build(self, values: dict[str, Any]) -> Message:
        """The message of checked field `values` (every required one, any optional one): what the
        frozen dataclass's __init__ does (defaults, then __post_init__), without its one
        object.__setattr__ per field (a decode's largest cost)."""
        for f in self.optional:
            if f.name not in values:
                values[f.name] = f.default()
        msg = object.__new__(self.cls)
        msg.__dict__.update(values)
        post_init = getattr(msg, "__post_init__", None)
        if post_init is not None:
            post_init()
        return msg

    @functools.cached_property
    def keys(self) -> frozenset[str]:
        """The keys a message of this type may have on the wire: its fields and "type"."""
        return frozenset(f.name for f in self.fields) | {"type"}


# type name -> spec. Written only by `@message` while message classes are being defined
# (import time) and read-only afterwards; it describes the protocol, not any job, so two
# jobs in one process share it safely.
_REGISTRY: dict[str, _Spec] = {}


class _Mismatch(Exception):
    """A value does not match its annotation; `got` says what came instead."""

    def __init__(self, got: str) -> None:
        super().__init__(got)
        self.got = got
        self.where = ""  # position inside the field, e.g. "[2]" or "['loss'][0]"

    def describe(self) -> str:
        return f"{self.got} at {self.where}" if self.where else self.got


# ---------------------------------------------------------------- registration


def message(type_name: str) -> Callable[[type[M]], type[M]]:
    """Class decorator: make `cls` a frozen dataclass and register it as `type_name`."""

    def register(cls: type[M]) -> type[M]:
        if not (isinstance(cls, type) and issubclass(cls, Message)):
            raise TypeError(f"@message({type_name!r}) must decorate a subclass of Message")
        if not type_name or not type_name.replace("_", "a").isalnum() or not type_name.islower():
            raise TypeError(f"message type {type_name!r} must be a non-empty snake_case name")
        if type_name in _RESERVED_TYPES:
            raise TypeError(f"message type {type_name!r} is reserved for the handshake")
        if type_name in _REGISTRY:
            other = _REGISTRY[type_name].cls
            raise TypeError(f"message type {type_name!r} is already taken by {other.__qualname__}")
        if "__dataclass_params__" not in cls.__dict__:
            cls = dataclass(frozen=True)(cls)
        elif not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
            raise TypeError(f"message {cls.__qualname__} must be a frozen dataclass")
        cls.TYPE = type_name
        _REGISTRY[type_name] = _Spec(cls, _fields_of(cls))
        return cls

    return register


def _fields_of(cls: type) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name == "type":
            raise TypeError(f"message {cls.__qualname__}: a field may not be named 'type'")
        annotation = hints[f.name]
        try:
            expected = _describe(annotation)
        except TypeError as exc:
            raise TypeError(f"message {cls.__qualname__}: field {f.name!r}: {exc}") from None
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory
        elif f.default is not dataclasses.MISSING:
            default = functools.partial(_same, f.default)
        else:
            default = None  # required
        out.append(_Field(f.name, annotation, expected, _converter(annotation), default))
    return tuple(out)


def _same(value: Any) -> Any:
    return value


def _describe(annotation: Any) -> str:
    """The annotation as text; TypeError if it is not one we can check on the wire."""
    if annotation in (int, float, str, bool, bytes):
        return annotation.__name__
    if annotation is Any:
        return "Any"
    if annotation is Encoded:
        return "an encoded message (a map)"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1 and len(args) == 2:
            return f"{_describe(inner[0])} | None"
    elif origin is list and len(args) == 1:
        return f"list[{_describe(args[0])}]"
    elif origin is dict and len(args) == 2 and args[0] is str:
        return f"dict[str, {_describe(args[1])}]"
    raise TypeError(
        f"unsupported annotation {annotation!r} (use int, float, str, bool, bytes, Any, Encoded, "
        "X | None, list[X] or dict[str, X])"
    )


# ---------------------------------------------------------------- checking values


def _type_name(value: Any) -> str:
    return "None" if value is None else type(value).__name__


# A converter checks one value against its annotation and returns it (ints widened to float, lists
# and dicts rebuilt); it raises _Mismatch. One is built per annotation, once, when a message class is
# registered (_converter), so a decode runs the checks without re-reading the annotation: the
# controller decodes two messages per rank per step.
_INT_MIN, _INT_END = -(2**63), 2**64  # what msgpack can carry
_PLAIN = frozenset({bool, float, str, bytes})  # Any's values that need no check


def _int(value: Any, depth: int) -> int:
    if type(value) is not int:  # excludes bool, a subclass of int
        raise _Mismatch(_type_name(value))
    if not _INT_MIN <= value < _INT_END:
        raise _Mismatch(f"int {value} outside the 64-bit range")
    return value


def _float(value: Any, depth: int) -> float:
    kind = type(value)
    if kind is float:
        return value
    if kind is int:
        return float(value)
    raise _Mismatch(_type_name(value))


def _str(value: Any, depth: int) -> str:
    if type(value) is str:
        return value
    if isinstance(value, enum.StrEnum):
        return str(value)  # a name of unbroken.names travels as its plain value
    raise _Mismatch(_type_name(value))


def _exactly(kind: type) -> Converter:
    def convert(value: Any, depth: int) -> Any:
        if type(value) is not kind:
            raise _Mismatch(_type_name(value))
        return value
    return convert


def _any(value: Any, depth: int) -> Any:
    """Any msgpack-able value, unchanged; nested at most _MAX_NESTING deep."""
    kind = type(value)
    if value is None or kind in _PLAIN:
        return value
    if kind is int:
        return _int(value, depth)
    if kind is list:
        _list(value, _any, depth)
        return value
    if kind is dict:
        _dict(value, _any, depth)
        return value
    raise _Mismatch(f"{_type_name(value)} (not msgpack-able)")


def _list(value: list, item: Converter, depth: int) -> list:
    fast = _SCALAR_LISTS.get(item)
    if fast is not None and depth < _MAX_NESTING:
        out = fast(value)
        if out is not None:
            return out
    out = []  # each item checked in turn: the error names the first one that is wrong
    for i, x in enumerate(value):
        if depth >= _MAX_NESTING:
            raise _Mismatch(f"values nested more than {_MAX_NESTING} deep")
        try:
            out.append(item(x, depth + 1))
        except _Mismatch as exc:
            exc.where = f"[{i}]{exc.where}"  # unwinding goes inside-out: prepend the outer step
            raise
    return out


def _ints(value: list) -> list | None:
    """A list of ints (not bools) in msgpack's range, checked in C passes; None: let the loop say what is wrong."""
    if value and (not set(map(type, value)) <= {int} or min(value) < _INT_MIN or max(value) >= _INT_END):
        return None
    return list(value)


def _floats(value: list) -> list | None:
    kinds = set(map(type, value))
    if kinds <= {float}:
        return list(value)
    return list(map(float, value)) if kinds <= {float, int} else None


def _strs(value: list) -> list | None:
    return list(value) if set(map(type, value)) <= {str} else None


#: A list of one scalar kind (a summary's columns, a batch's pids): checked without a call per item.
_SCALAR_LISTS: dict[Converter, Callable[[list], list | None]] = {_int: _ints, _float: _floats, _str: _strs}


def _dict(value: dict, item: Converter, depth: int) -> dict:
    out = {}
    for key, x in value.items():
        if type(key) is not str:
            raise _Mismatch(f"key {key!r} of type {_type_name(key)}")
        if depth >= _MAX_NESTING:
            raise _Mismatch(f"values nested more than {_MAX_NESTING} deep")
        try:
            out[key] = item(x, depth + 1)
        except _Mismatch as exc:
            exc.where = f"[{key!r}]{exc.where}"
            raise
    return out


@functools.cache
def _converter(annotation: Any) -> Converter:
    """The converter of a supported annotation (_describe has accepted it)."""
    simple = {int: _int, float: _float, str: _str, bool: _exactly(bool), bytes: _exactly(bytes),
              Encoded: _exactly(dict)}
    if annotation in simple:
        return simple[annotation]
    if annotation is Any:
        return _any
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        inner = _converter(next(a for a in args if a is not type(None)))
        return lambda value, depth: None if value is None else inner(value, depth)
    item = _converter(args[-1])
    kind, rebuild = (list, _list) if origin is list else (dict, _dict)

    def container(value: Any, depth: int) -> Any:
        if type(value) is not kind:
            raise _Mismatch(_type_name(value))
        return rebuild(value, item, depth)
    return container


# ---------------------------------------------------------------- encode / decode


def encode(msg: Message) -> dict[str, Any]:
    """`msg` as a plain msgpack-able dict with its "type"; ProtocolError if a field is bad."""
    spec = _REGISTRY.get(getattr(msg, "TYPE", ""))
    if spec is None or type(msg) is not spec.cls:
        raise ProtocolError(
            f"cannot encode {msg!r}: {type(msg).__qualname__} is not a registered message"
        )
    out: dict[str, Any] = {"type": msg.TYPE}
    f = None
    try:
        for f in spec.fields:
            out[f.name] = f.convert(getattr(msg, f.name), 0)
    except _Mismatch as exc:
        raise _field_error(msg.TYPE, f, exc) from None
    return out


def decode(obj: Any) -> Message:
    """The message `obj` (a decoded frame) describes; ProtocolError if it does not fit."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"a message must be a map, got {_type_name(obj)}")
    type_name = obj.get("type")
    if type_name is None:
        keys = ", ".join(sorted(map(str, obj))) or "none"
        raise ProtocolError(f"message has no 'type' field (keys: {keys})")
    spec = _REGISTRY.get(type_name) if isinstance(type_name, str) else None
    if spec is None:
        raise ProtocolError(
            f"unknown message type {type_name!r} (protocol version {PROTOCOL_VERSION} knows: "
            f"{', '.join(sorted(_REGISTRY))})"
        )
    if not spec.keys.issuperset(obj):
        unknown = sorted(str(k) for k in obj if k not in spec.keys)
        raise ProtocolError(
            f"message {type_name!r}: unknown field {unknown[0]!r} "
            f"(fields: {', '.join(f.name for f in spec.fields)})"
        )
    kwargs = {}
    f = None
    try:  # one try for all fields: the controller decodes two messages per rank per step
        for f in spec.fields:
            value = obj.get(f.name, _ABSENT)
            if value is not _ABSENT:
                kwargs[f.name] = f.convert(value, 0)
            elif f.required:
                raise ProtocolError(
                    f"message {type_name!r}: missing required field {f.name!r} ({f.expected})"
                )
    except _Mismatch as exc:
        raise _field_error(type_name, f, exc) from None
    return spec.build(kwargs)


def _field_error(type_name: str, f: _Field, exc: _Mismatch) -> ProtocolError:
    return ProtocolError(f"message {type_name!r}: field {f.name!r} must be {f.expected}, got {exc.describe()}")


def message_types() -> dict[str, type[Message]]:
    """A fresh copy of the registered message classes by type name."""
    return {name: spec.cls for name, spec in _REGISTRY.items()}
