"""The supervisor's rules as plain data and logic (no processes): specs, strategies, intensity."""

from __future__ import annotations

import pytest

from engine.runtime.child_spec import (
    ROOT,
    ChildSpec,
    Restart,
    RingDecl,
    Strategy,
    SupervisorSpec,
    start_units,
)
from engine.runtime.restart_policy import RestartIntensity, restart_set

ENTRY = "tests.integration.sample_actors:EchoActor"


def spec(*children: ChildSpec, **fields: object) -> SupervisorSpec:
    return SupervisorSpec(children=children, **fields)  # type: ignore[arg-type]


def kid(name: str, group: str = "") -> ChildSpec:
    return ChildSpec(name=name, entry=ENTRY, group=group)


def test_a_group_is_one_unit_placed_at_its_first_member() -> None:
    children = (kid("w0", "tp"), kid("sched"), kid("w1", "tp"), kid("detok"))
    assert start_units(children) == [["w0", "w1"], ["sched"], ["detok"]]


@pytest.mark.parametrize(
    ("strategy", "failed", "expected"),
    [
        (Strategy.ONE_FOR_ONE, "b", ["b"]),
        (Strategy.ONE_FOR_ONE, "w1", ["w0", "w1"]),  # the group comes along
        (Strategy.ONE_FOR_ALL, "b", ["w0", "w1", "b", "c"]),
        (Strategy.REST_FOR_ONE, "b", ["b", "c"]),
        (Strategy.REST_FOR_ONE, "w0", ["w0", "w1", "b", "c"]),
    ],
)
def test_the_strategy_chooses_which_children_restart(
    strategy: Strategy, failed: str, expected: list[str]
) -> None:
    units = [["w0", "w1"], ["b"], ["c"]]
    assert restart_set(strategy, units, failed) == expected


def test_restart_types_decide_by_exit_status() -> None:
    assert Restart.PERMANENT.wants_restart(0) and Restart.PERMANENT.wants_restart(-9)
    assert Restart.TRANSIENT.wants_restart(1) and not Restart.TRANSIENT.wants_restart(0)
    assert not Restart.TEMPORARY.wants_restart(1)


def test_intensity_allows_r_restarts_in_t_seconds_with_doubling_backoff() -> None:
    now = [0.0]
    intensity = RestartIntensity(3, 10.0, 0.1, 0.3, clock=lambda: now[0])
    delays = []
    for _ in range(3):
        assert intensity.record("a")
        delays.append(intensity.backoff(["a"]))
        now[0] += 1.0
    assert delays == [0.0, 0.1, 0.2]
    assert not intensity.record("b")  # a 4th within 10 s, whichever child
    assert "4 restarts within 10 s (at most 3 allowed)" in intensity.describe()

    now[0] += 11.0  # the window has moved past all of them
    assert intensity.record("a") and intensity.backoff(["a"]) == 0.0


def test_backoff_stops_growing_at_its_maximum() -> None:
    intensity = RestartIntensity(10, 60.0, 0.1, 0.3, clock=lambda: 0.0)
    delays = []
    for _ in range(5):
        intensity.record("a")
        delays.append(intensity.backoff(["a"]))
    assert delays == [0.0, 0.1, 0.2, 0.3, 0.3]


def test_children_failing_independently_do_not_delay_each_others_restarts() -> None:
    intensity = RestartIntensity(10, 60.0, 0.1, 1.0, clock=lambda: 0.0)
    for child in ("a", "b", "c"):
        intensity.record(child)
        assert intensity.backoff([child]) == 0.0  # each one's first restart: at once
    intensity.record("a")
    intensity.record("c")
    assert intensity.backoff(["a", "c"]) == 0.1  # restarted together: the longer wait
    intensity.record("a")
    assert intensity.backoff(["a", "b"]) == 0.2


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (spec(kid("a"), kid("a")), "child names must be unique names"),
        (spec(kid("Tok")), r"child name must be .*got 'Tok'"),
        (spec(ChildSpec(name="a", entry="no_colon")), r"child 'a' entry must be 'module:Class'"),
        (spec(kid(ROOT)), "child name must be any name but 'root'"),
        (
            spec(ChildSpec(name="a", entry=ENTRY, heartbeat_interval=2.0, heartbeat_timeout=1.0)),
            r"child 'a' heartbeat_timeout must be > heartbeat_interval \(2.0\), got 1.0",
        ),
        (
            spec(ChildSpec(name="a", entry=ENTRY, restart="sometimes")),  # type: ignore[arg-type]
            r"child 'a' restart must be Restart.PERMANENT .*got 'sometimes'",
        ),
        (
            spec(kid("a"), rings=(RingDecl(name="in", writer=ROOT, readers=("b",)),)),
            r"ring 'in' reader must be a child name or 'root', got 'b'",
        ),
        (
            spec(kid("a"), rings=(RingDecl(name="in", writer="a", readers=("a",)),)),
            r"ring 'in' readers must be not its writer",
        ),
        (
            spec(kid("a"), rings=(RingDecl(name="in", writer=ROOT, readers=("a",), capacity=0),)),
            r"ring 'in' capacity must be a positive byte count, got 0",
        ),
        (spec(kid("a"), max_seconds=0.0), r"max_seconds must be a number > 0, got 0.0"),
        (spec(kid("a"), log_level="LOUD"), r"log_level must be .*got 'LOUD'"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_field_the_value_and_the_expected_form(
    bad: SupervisorSpec, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        bad.validate()
