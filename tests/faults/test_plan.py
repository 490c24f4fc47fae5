"""The `--inject` plan language: good plans, canonical text, round trips and every error."""

import dataclasses

import pytest

from unbroken.errors import ConfigError
from unbroken.faults.plan import (
    CORRUPT_TARGETS,
    FAULT_PHASES,
    Fault,
    FaultKind,
    format_plan,
    parse_plan,
    validate_plan,
)


# ---------------------------------------------------------------------------- good plans


def test_example_plan_from_the_docs():
    plan = parse_plan("kill:rank=2:step=30,hang:rank=1:step=60,raise:rank=0:step=90")
    assert plan == (
        Fault(FaultKind.KILL, rank=2, step=30),
        Fault(FaultKind.HANG, rank=1, step=60),
        Fault(FaultKind.RAISE, rank=0, step=90),
    )
    assert all(fault.at == "compute" for fault in plan)


@pytest.mark.parametrize("text", ["", "   ", "\n"])
def test_empty_text_is_the_empty_plan(text):
    assert parse_plan(text) == ()
    assert format_plan(()) == ""


@pytest.mark.parametrize("kind", list(FaultKind))
def test_every_kind_parses(kind):
    (fault,) = parse_plan(f"{kind.value}:rank=0:step=0")
    assert fault.kind is kind
    assert (fault.rank, fault.step, fault.at, fault.params) == (0, 0, "compute", ())


@pytest.mark.parametrize("phase", FAULT_PHASES)
def test_every_phase_parses(phase):
    (fault,) = parse_plan(f"kill:rank=1:step=3:at={phase}")
    assert fault.at == phase


def test_keys_in_any_order_and_whitespace_around_items_and_values():
    plan = parse_plan(" kill : step = 7 : rank = 3 : at = sync ,  exit:code=3:rank=0:step=1 ")
    assert plan == (
        Fault(FaultKind.KILL, rank=3, step=7, at="sync"),
        Fault(FaultKind.EXIT, rank=0, step=1, params=(("code", "3"),)),
    )


def test_exit_code_default_and_explicit():
    default, explicit, zero = parse_plan(
        "exit:rank=0:step=1,exit:rank=0:step=2:code=7,exit:rank=0:step=3:code=0"
    )
    assert default.exit_code == 1 and default.params == ()
    assert explicit.exit_code == 7 and explicit.params == (("code", "7"),)
    assert zero.exit_code == 0


@pytest.mark.parametrize("what", CORRUPT_TARGETS)
def test_corrupt_targets(what):
    (fault,) = parse_plan(f"corrupt:rank=1:step=4:what={what}")
    assert fault.corrupt_target == what


def test_corrupt_defaults_to_params():
    (fault,) = parse_plan("corrupt:rank=1:step=4")
    assert fault.corrupt_target == "params"


def test_large_numbers_are_fine():
    (fault,) = parse_plan("kill:rank=4095:step=10000000")
    assert (fault.rank, fault.step) == (4095, 10_000_000)


def test_same_point_different_kinds_are_kept_in_plan_order():
    plan = parse_plan("raise:rank=0:step=5,kill:rank=0:step=5")
    assert [fault.kind for fault in plan] == [FaultKind.RAISE, FaultKind.KILL]


# --------------------------------------------------------------- canonical text, roundtrip


@pytest.mark.parametrize(
    "text, canonical",
    [
        ("kill:rank=2:step=30", "kill:rank=2:step=30"),
        ("kill:step=30:rank=2", "kill:rank=2:step=30"),
        ("kill:rank=2:step=30:at=compute", "kill:rank=2:step=30"),
        ("hang:rank=1:step=60:at=sync", "hang:rank=1:step=60:at=sync"),
        ("exit:rank=0:step=5:code=1", "exit:rank=0:step=5"),
        ("exit:code=007:rank=0:step=5", "exit:rank=0:step=5:code=7"),
        ("corrupt:rank=0:step=5:what=params", "corrupt:rank=0:step=5"),
        ("corrupt:what=grads:at=update:step=5:rank=0", "corrupt:rank=0:step=5:at=update:what=grads"),
        ("nan:rank=0:step=05", "nan:rank=0:step=5"),
    ],
)
def test_canonical_text_and_fault_id(text, canonical):
    (fault,) = parse_plan(text)
    assert str(fault) == canonical
    assert fault.fault_id == canonical


def test_roundtrip_of_a_plan_using_every_feature():
    text = (
        "kill:rank=2:step=30,hang:rank=1:step=60:at=sync,raise:rank=0:step=90:at=update,"
        "exit:rank=3:step=4:at=checkpoint:code=9,corrupt:rank=1:step=2:what=optimizer,"
        "nan:rank=0:step=11,subhealth:rank=2:step=12"
    )
    plan = parse_plan(text)
    assert format_plan(plan) == text  # already canonical
    assert parse_plan(format_plan(plan)) == plan


def test_roundtrip_normalizes_non_canonical_text():
    plan = parse_plan("exit:step=3:rank=0:code=1, kill:rank=1:step=2:at=compute")
    assert format_plan(plan) == "exit:rank=0:step=3,kill:rank=1:step=2"
    assert parse_plan(format_plan(plan)) == plan


def test_fault_built_in_code_equals_parsed_one():
    built = Fault(FaultKind.EXIT, rank=0, step=5, params=(("code", "1"),))
    assert built == parse_plan("exit:rank=0:step=5")[0]
    built = Fault(FaultKind.EXIT, rank=0, step=5, params=(("code", "02"),))
    assert built.params == (("code", "2"),)


def test_fault_is_frozen_and_hashable():
    fault = Fault(FaultKind.KILL, rank=0, step=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fault.rank = 3  # type: ignore[misc]
    assert len({fault, Fault(FaultKind.KILL, rank=0, step=1)}) == 1


def test_fault_ids_are_unique_within_a_parsed_plan():
    plan = parse_plan("kill:rank=0:step=1,kill:rank=1:step=1,kill:rank=0:step=1:at=sync,hang:rank=0:step=1")
    assert len({fault.fault_id for fault in plan}) == len(plan)


# ----------------------------------------------------------------------------- errors


def _error(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_plan(text)
    return str(info.value)


def test_unknown_kind_message_names_item_and_allowed_kinds():
    assert _error("kil:rank=2:step=3") == (
        "--inject: 'kil:rank=2:step=3': unknown fault kind 'kil' "
        "(allowed: kill, hang, raise, exit, corrupt, nan, subhealth, flip)"
    )


def test_error_names_the_bad_item_not_its_neighbours():
    message = _error("kill:rank=0:step=1,hang:rank=1:step=x")
    assert message.startswith("--inject: 'hang:rank=1:step=x': ")
    assert "kill:rank=0" not in message


def test_source_names_where_the_plan_came_from():
    with pytest.raises(ConfigError, match=r"^faults\.inject: 'boom:rank=0:step=0': "):
        parse_plan("boom:rank=0:step=0", source="faults.inject")


def test_kind_is_case_sensitive():
    assert "unknown fault kind 'KILL'" in _error("KILL:rank=0:step=1")


@pytest.mark.parametrize(
    "text, missing",
    [("kill:step=3", "rank"), ("kill:rank=3", "step"), ("kill", "rank")],
)
def test_missing_rank_or_step(text, missing):
    assert f"missing '{missing}'" in _error(text)


@pytest.mark.parametrize(
    "text, key, value",
    [
        ("kill:rank=two:step=3", "rank", "'two'"),
        ("kill:rank=2:step=3.5", "step", "'3.5'"),
        ("kill:rank=2:step=", "step", "''"),
        ("kill:rank=+2:step=3", "rank", "'+2'"),
        ("kill:rank=1_0:step=3", "rank", "'1_0'"),
        ("kill:rank=2=3:step=3", "rank", "'2=3'"),
        ("exit:rank=0:step=1:code=x", "code", "'x'"),
    ],
)
def test_non_integer(text, key, value):
    assert f"'{key}' must be an integer >= 0, got {value}" in _error(text)


@pytest.mark.parametrize("text, key", [("kill:rank=-1:step=3", "rank"), ("kill:rank=1:step=-3", "step")])
def test_negative(text, key):
    message = _error(text)
    assert f"'{key}' must be an integer >= 0, got -" in message
    assert message.startswith(f"--inject: {text!r}: ")


def test_exit_code_out_of_range():
    assert "'code' must be an exit status 0..255, got 256" in _error("exit:rank=0:step=1:code=256")


def test_unknown_key_lists_allowed_keys_of_the_kind():
    assert _error("kill:rank=0:step=1:when=3") == (
        "--inject: 'kill:rank=0:step=1:when=3': unknown key 'when' (allowed keys: rank, step, at)"
    )
    assert "(allowed keys: rank, step, at, code)" in _error("exit:rank=0:step=1:signal=9")


def test_field_without_equals_sign():
    assert "'rank' is not key=value" in _error("kill:rank:step=1")


def test_key_given_twice_in_one_item():
    assert "key 'rank' given twice" in _error("kill:rank=0:rank=1:step=1")


@pytest.mark.parametrize("kind", ["kill", "hang", "raise", "exit", "nan", "subhealth"])
def test_what_on_a_non_corrupt_fault(kind):
    message = _error(f"{kind}:rank=0:step=1:what=params")
    assert f"key 'what' is only allowed on corrupt and flip faults, not on {kind}" in message


def test_code_on_a_non_exit_fault():
    assert "key 'code' is only allowed on exit faults, not on kill" in _error("kill:rank=0:step=1:code=3")


def test_unknown_corrupt_target():
    assert "unknown what='weights' (allowed: params, optimizer, grads)" in _error(
        "corrupt:rank=0:step=1:what=weights"
    )


@pytest.mark.parametrize("phase", ["backward", "COMPUTE", ""])
def test_bad_phase(phase):
    message = _error(f"kill:rank=0:step=1:at={phase}")
    allowed = "compute, sync, vote, update, checkpoint, restore; default compute"
    assert f"unknown phase at={phase!r} (allowed: {allowed})" in message


@pytest.mark.parametrize(
    "text, duplicate",
    [
        ("kill:rank=2:step=30,kill:rank=2:step=30", "kill:rank=2:step=30"),
        ("kill:rank=2:step=30,kill:step=30:rank=2:at=compute", "kill:rank=2:step=30"),
        ("exit:rank=0:step=5,exit:rank=0:step=5:code=1", "exit:rank=0:step=5"),
        ("corrupt:rank=0:step=5:what=params,corrupt:rank=0:step=5", "corrupt:rank=0:step=5"),
    ],
)
def test_duplicate_fault(text, duplicate):
    message = _error(text)
    assert f"duplicate fault: {duplicate} appears twice in the plan" in message
    second_item = text.split(",")[1]
    assert message.startswith(f"--inject: {second_item!r}: ")


@pytest.mark.parametrize("text", ["kill:rank=0:step=1,", ",kill:rank=0:step=1", "kill:rank=0:step=1,,hang:rank=0:step=2"])
def test_empty_item(text):
    assert "empty fault" in _error(text)


def test_every_error_is_a_value_error_too():
    with pytest.raises(ValueError):
        parse_plan("kill:rank=x:step=1")


# --------------------------------------------------------------- Fault built in code


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kind="kill", rank=0, step=0), "must be a FaultKind"),
        (dict(kind=FaultKind.KILL, rank=-1, step=0), "'rank' must be an integer >= 0"),
        (dict(kind=FaultKind.KILL, rank=True, step=0), "'rank' must be an integer >= 0"),
        (dict(kind=FaultKind.KILL, rank=0, step=1.0), "'step' must be an integer >= 0"),
        (dict(kind=FaultKind.KILL, rank=0, step=0, at="later"), "unknown phase"),
        (dict(kind=FaultKind.KILL, rank=0, step=0, params=(("code", "3"),)), "only allowed on exit"),
        (dict(kind=FaultKind.EXIT, rank=0, step=0, params=(("rank", "3"),)), "is a field of Fault"),
        (dict(kind=FaultKind.EXIT, rank=0, step=0, params=(("code", "3"), ("code", "4"))), "given twice"),
        (dict(kind=FaultKind.EXIT, rank=0, step=0, params=(("code", 3),)), "pairs of strings"),
        (dict(kind=FaultKind.CORRUPT, rank=0, step=0, params=(("what", "disk"),)), "unknown what"),
    ],
)
def test_invalid_fault_built_in_code(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Fault(**kwargs)


# ------------------------------------------------------------------- validate_plan


def test_validate_plan_accepts_ranks_inside_the_world():
    validate_plan(parse_plan("kill:rank=0:step=1,hang:rank=3:step=2"), world_size=4)
    validate_plan((), world_size=1)


def test_validate_plan_rejects_a_rank_outside_the_world():
    plan = parse_plan("kill:rank=0:step=1,hang:rank=4:step=2")
    with pytest.raises(ConfigError) as info:
        validate_plan(plan, world_size=4)
    assert str(info.value) == (
        "--inject: 'hang:rank=4:step=2': rank 4 does not exist in a job of world size 4 "
        "(allowed ranks: 0..3)"
    )


def test_validate_plan_rejects_a_bad_world_size():
    with pytest.raises(ConfigError, match="world size must be >= 1"):
        validate_plan((), world_size=0)
