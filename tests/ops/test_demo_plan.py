"""The fault plans of `unbroken demo` (pure: no run)."""

from __future__ import annotations


def test_demo_fault_plans_are_valid_and_the_ddp_plan_uses_what_ddp_recovers_in_flight():
    from unbroken.cli.demo import fault_plan
    from unbroken.faults.plan import parse_plan, validate_plan

    for script in ("gpt", "ddp"):
        faults = parse_plan(fault_plan(script, 60, 4))
        validate_plan(faults, 4)
    kinds = [f.split(":")[0] for f in fault_plan("ddp", 60, 4).split(",")]
    assert kinds == ["kill", "kill", "hang"]  # no retry-rung faults: DDP's all-reduce runs inside backward
