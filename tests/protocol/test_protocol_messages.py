"""Typed control messages: registration, encode/decode round trips, strict validation."""

import dataclasses
import types
import typing
from typing import Any

import msgpack
import pytest

from unbroken.errors import ProtocolError
from unbroken.protocol import messages as m
from unbroken.protocol.messages import Encoded, Message, decode, encode, message, message_types

EXAMPLES = [
    m.AgentRegister(node_rank=1, nproc=8, host="node-1", pid=4242),
    m.RankStarted(rank=3, pid=100, attempt=0),
    m.RankExited(rank=3, pid=100, attempt=2, exit_code=None, signal=9, last_lines=["a", "b"]),
    m.RankExited(rank=0, pid=1, attempt=0, exit_code=1, signal=None, last_lines=[]),
    m.RanksStopped(node_rank=0, attempt=1),
    m.StartRanks(attempt=1, store_host="10.0.0.1", store_port=29500, world_size=16),
    m.StopRanks(attempt=1, reason="rank 3 died"),
    m.KillRank(rank=3, pid=100, reason="hung for 30 s"),
    m.Shutdown(exit_code=0, reason="done"),
    m.RankRegister(rank=5, pid=77, attempt=0),
    m.Progress(
        rank=0, attempt=0, step=12, phase="train",
        metrics={"loss": 2.5, "tokens": 1024, "ok": True, "tags": ["x", None], "raw": b"\x00"},
    ),
    m.Heartbeat(rank=7),
    m.ClaimFault(rank=2, fault_id="f-1"),
    m.FaultClaim(fault_id="f-1", granted=False),
]


def _sample(annotation: Any) -> Any:
    """A valid value for any supported annotation (so new messages are covered too)."""
    simple = {int: 7, float: 1.5, str: "s", bool: True, bytes: b"\x01", Any: {"k": [1]}, Encoded: {"type": "heartbeat", "rank": 1}}
    if annotation in simple:
        return simple[annotation]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return _sample(next(a for a in args if a is not type(None)))
    if origin is list:
        return [_sample(args[0]), _sample(args[0])]
    assert origin is dict, annotation
    return {"a": _sample(args[1])}


def _wire(obj: dict) -> dict:
    """What the peer gets after msgpack, as in a real frame."""
    return msgpack.unpackb(msgpack.packb(obj, use_bin_type=True), raw=False)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda msg: type(msg).__name__)
def test_examples_round_trip_through_msgpack(msg: Message) -> None:
    obj = encode(msg)
    assert obj["type"] == msg.TYPE
    assert decode(_wire(obj)) == msg


@pytest.mark.timeout(20)
@pytest.mark.parametrize("type_name", sorted(message_types()))
def test_every_registered_message_round_trips(type_name: str) -> None:
    cls = message_types()[type_name]
    hints = typing.get_type_hints(cls)
    msg = cls(**{f.name: _sample(hints[f.name]) for f in dataclasses.fields(cls)})
    assert decode(_wire(encode(msg))) == msg
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.x = 1  # type: ignore[attr-defined]


@pytest.mark.timeout(20)
def test_initial_messages_are_registered_at_version_1() -> None:
    assert m.PROTOCOL_VERSION == 1
    expected = {type(msg).TYPE for msg in EXAMPLES}
    assert expected <= set(message_types())
    assert m.Progress.TYPE == "progress" and m.FaultClaim.TYPE == "fault_claim"


def _progress(**changes: Any) -> dict:
    obj = encode(m.Progress(rank=0, attempt=0, step=1, phase="train", metrics={}))
    obj.update(changes)
    return obj


BAD = [
    (_progress(step="3"), "message 'progress': field 'step' must be int, got str"),
    (_progress(step=True), "field 'step' must be int, got bool"),
    (_progress(step=None), "field 'step' must be int, got None"),
    (_progress(step=1.0), "field 'step' must be int, got float"),
    (_progress(step=2**70), "field 'step' must be int, got int"),
    (_progress(phase=b"train"), "field 'phase' must be str, got bytes"),
    (_progress(metrics=[1]), "field 'metrics' must be dict[str, Any], got list"),
    (
        _progress(metrics={"a": {1: 2}}),
        "field 'metrics' must be dict[str, Any], got key 1 of type int at ['a']",
    ),
    (_progress(metrics={"a": [1, {2, 3}]}), "field 'metrics' must be dict[str, Any], got set"),
    (_progress(extra=1), "message 'progress': unknown field 'extra'"),
    ({"type": "fault_claim", "granted": True}, "message 'fault_claim': missing required field 'fault_id' (str)"),
    ({"type": "fault_claim", "granted": 1, "fault_id": ""}, "message 'fault_claim': field 'granted' must be bool, got int"),
    (
        {"type": "fault_claim", "fault_id": 3, "granted": True},
        "field 'fault_id' must be str, got int",
    ),
    (
        {"type": "rank_exited", "rank": 0, "pid": 1, "attempt": 0, "exit_code": None,
         "signal": "KILL", "last_lines": []},
        "message 'rank_exited': field 'signal' must be int | None, got str",
    ),
    (
        {"type": "rank_exited", "rank": 0, "pid": 1, "attempt": 0, "exit_code": None,
         "signal": None, "last_lines": ["ok", 3]},
        "message 'rank_exited': field 'last_lines' must be list[str], got int at [1]",
    ),
    (
        {"type": "rank_exited", "rank": 0, "pid": 1, "attempt": 0, "exit_code": None,
         "signal": None, "last_lines": "ok"},
        "field 'last_lines' must be list[str], got str",
    ),
    ({"type": "node_reports", "entries": [{"type": "heartbeat", "rank": 0}, 5], "pids": [1, 2]},
     "field 'entries' must be list[an encoded message (a map)], got int at [1]"),
    # a list of one scalar kind is checked in whole-list passes; a wrong item still gets its place named
    ({"type": "node_reports", "entries": [], "pids": [1, 2, True, 4]}, "field 'pids' must be list[int], got bool at [2]"),
    ({"type": "node_reports", "entries": [], "pids": [1, 2**64]},
     "field 'pids' must be list[int], got int 18446744073709551616 outside the 64-bit range at [1]"),
    ({"type": "group_summary", "agents": [1], "attempts": [0], "nranks": [2], "done": [3], "age_s": [0.1, "x"],
      "step_s": 1.0, "ckpt_s": 0.0, "compute_s": [0.5], "slow_rank": [-1], "slow_s": [-1.0]},
     "field 'age_s' must be list[float], got str at [1]"),
    ({"type": "no_such_thing"}, "unknown message type 'no_such_thing'"),
    ({"type": 5}, "unknown message type 5"),
    ({"rank": 1}, "message has no 'type' field"),
    ([1, 2], "a message must be a map, got list"),
]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("obj, text", BAD, ids=[text for _, text in BAD])
def test_bad_messages_raise_protocol_error_naming_the_field(obj: Any, text: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(obj)
    assert text in str(info.value)


@pytest.mark.timeout(20)
def test_nested_position_is_named() -> None:
    obj = _progress(metrics={"hist": [1, 2, {"deep": object()}]})
    where = r"\['hist'\]\[2\]\['deep'\]"
    with pytest.raises(ProtocolError, match=rf"got object \(not msgpack-able\) at {where}"):
        decode(obj)


@pytest.mark.timeout(20)
def test_values_nested_too_deep_are_refused_not_recursed() -> None:
    deep: Any = 1
    for _ in range(40):
        deep = [deep]
    with pytest.raises(ProtocolError, match=r"field 'metrics' must be .*values nested more than 32 deep at \['d'\](\[0\]){31}$"):
        decode(_progress(metrics={"d": deep}))
    shallow: Any = 1
    for _ in range(30):
        shallow = [shallow]
    assert decode(_progress(metrics={"d": shallow})).metrics == {"d": shallow}


@pytest.mark.timeout(20)
def test_a_decoded_message_is_the_one_its_constructor_builds() -> None:
    """decode builds a message without its __init__: defaults, default factories (fresh per
    message), __post_init__ and frozenness must be what the constructor gives."""
    a = decode({"type": "rank_resumed", "rank": 1, "attempt": 0, "gen": 2, "step": 3, "restore_s": 0.5})
    b = decode({"type": "rank_resumed", "rank": 1, "attempt": 0, "gen": 2, "step": 3, "restore_s": 0.5})
    assert a == m.RankResumed(rank=1, attempt=0, gen=2, step=3, restore_s=0.5)
    assert a.phases == {} and a.phases is not b.phases
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.rank = 5  # type: ignore[misc]
    with pytest.raises(ProtocolError, match="field 'round' must be >= 0, got -1"):
        decode({"type": "restore_offer", "rank": 0, "attempt": 0, "round": -1,
                "memory_steps": [], "storage_steps": []})


@pytest.mark.timeout(20)
def test_float_field_accepts_int_but_not_bool() -> None:
    @message("zz_test_protocol_float")
    class Scaled(Message):
        factor: float
        note: str | None = None  # optional on the wire: it has a default

    got = decode({"type": "zz_test_protocol_float", "factor": 3})
    assert got == Scaled(factor=3.0) and type(got.factor) is float  # type: ignore[attr-defined]
    with pytest.raises(ProtocolError, match="field 'factor' must be float, got bool"):
        decode({"type": "zz_test_protocol_float", "factor": True})
    assert encode(Scaled(factor=1.0, note="n")) == {
        "type": "zz_test_protocol_float", "factor": 1.0, "note": "n"
    }


@pytest.mark.timeout(20)
def test_encode_checks_fields_too() -> None:
    text = "message 'heartbeat': field 'rank' must be int, got str"
    with pytest.raises(ProtocolError, match=text):
        encode(m.Heartbeat(rank="0"))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="not a registered message"):
        encode(object())  # type: ignore[arg-type]


@pytest.mark.timeout(20)
def test_registration_refuses_mistakes() -> None:
    with pytest.raises(TypeError, match="already taken"):

        @message("progress")
        class Again(Message):
            rank: int

    with pytest.raises(TypeError, match="unsupported annotation"):

        @message("zz_test_protocol_set")
        class WithSet(Message):
            ranks: set[int]

    with pytest.raises(TypeError, match="may not be named 'type'"):

        @message("zz_test_protocol_type_field")
        class WithType(Message):
            type: str

    with pytest.raises(TypeError, match="frozen"):

        @message("zz_test_protocol_mutable")
        @dataclasses.dataclass
        class Mutable(Message):
            rank: int

    with pytest.raises(TypeError, match="reserved"):

        @message("hello")
        class Hello(Message):
            rank: int

    with pytest.raises(TypeError, match="subclass of Message"):

        @message("zz_test_protocol_plain")
        class Plain:
            rank: int

    assert not {"zz_test_protocol_set", "zz_test_protocol_type_field"} & set(message_types())


RESTORE_EXAMPLES = [
    m.RestoreOffer(rank=3, attempt=1, round=0, memory_steps=[10, 5], storage_steps=[10, 5, 0]),
    m.RestoreOffer(rank=0, attempt=0, round=2, memory_steps=[], storage_steps=[]),
    m.RestoreAt(attempt=1, round=0, step=10),
    m.RestoreAt(attempt=0, round=1, step=-1),  # nothing restorable: start fresh
]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("msg", RESTORE_EXAMPLES, ids=lambda msg: f"{type(msg).__name__}-{msg.round}")
def test_restore_messages_round_trip(msg: Message) -> None:
    assert decode(_wire(encode(msg))) == msg


def _offer(**changes: Any) -> dict:
    obj = encode(m.RestoreOffer(rank=1, attempt=0, round=0, memory_steps=[5], storage_steps=[5]))
    obj.update(changes)
    return obj


BAD_RESTORE = [
    (_offer(memory_steps=[5, "4"]), "message 'restore_offer': field 'memory_steps' must be list[int], got str at [1]"),
    (_offer(storage_steps=5), "message 'restore_offer': field 'storage_steps' must be list[int], got int"),
    (_offer(storage_steps=[10, -3]), "message 'restore_offer': field 'storage_steps' must be >= 0, got -3 at [1]"),
    (_offer(round=-1), "message 'restore_offer': field 'round' must be >= 0, got -1"),
    (_offer(rank=-2), "message 'restore_offer': field 'rank' must be >= 0, got -2"),
    (_offer(round=True), "field 'round' must be int, got bool"),
    ({"type": "restore_offer", "rank": 0, "attempt": 0, "round": 0, "memory_steps": []},
     "message 'restore_offer': missing required field 'storage_steps' (list[int])"),
    ({"type": "restore_at", "attempt": 0, "round": 0, "step": -2},
     "message 'restore_at': field 'step' must be >= -1, got -2"),
    ({"type": "restore_at", "attempt": 0, "round": 0, "step": 1.0}, "field 'step' must be int, got float"),
    ({"type": "restore_at", "attempt": 0, "round": 0, "step": 3, "tier": "memory"},
     "message 'restore_at': unknown field 'tier'"),
]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("obj, text", BAD_RESTORE, ids=[text for _, text in BAD_RESTORE])
def test_bad_restore_messages_are_rejected_naming_the_field(obj: Any, text: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(obj)
    assert text in str(info.value)


@pytest.mark.timeout(20)
def test_restore_messages_refuse_bad_values_when_built_too() -> None:
    with pytest.raises(ProtocolError, match="field 'memory_steps' must be >= 0, got -1 at \\[0\\]"):
        m.RestoreOffer(rank=0, attempt=0, round=0, memory_steps=[-1], storage_steps=[])
    with pytest.raises(ProtocolError, match="field 'step' must be >= -1, got -5"):
        m.RestoreAt(attempt=0, round=0, step=-5)
