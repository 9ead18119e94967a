"""The P/D proxy's instance choice and marking (no servers): least outstanding requests, turns
among equals, down instances never chosen, and a 503 message that names each instance."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from engine.proxy.pool import InstancePool, NoInstanceUp, Role
from engine.proxy.upstream import Verdict, judge

P1, P2 = "http://p1:8000", "http://p2:8000"
D1, D2, D3 = "http://d1:8000", "http://d2:8000", "http://d3:8000"


def pool() -> InstancePool:
    return InstancePool.of([P1, P2], [D1, D2, D3])


def test_equally_busy_instances_take_turns() -> None:
    instances = pool()
    chosen = [instances.choose(Role.DECODE).url for _ in range(6)]
    assert chosen == [D1, D2, D3, D1, D2, D3]
    assert [instances.choose(Role.PREFILL).url for _ in range(3)] == [P1, P2, P1]


def test_the_least_busy_instance_is_chosen() -> None:
    instances = pool()
    d1, d2, d3 = instances.of_role(Role.DECODE)
    d1.outstanding, d2.outstanding, d3.outstanding = 3, 1, 2
    assert instances.choose(Role.DECODE) is d2
    d2.outstanding = 5
    assert instances.choose(Role.DECODE) is d3


def test_requests_in_flight_spread_over_instances() -> None:
    """Each choice's request stays outstanding: n requests land n/3 on each instance."""
    instances = pool()
    load: Counter[str] = Counter()
    for _ in range(9):
        chosen = instances.choose(Role.DECODE)
        chosen.outstanding += 1
        load[chosen.url] += 1
    assert load == {D1: 3, D2: 3, D3: 3}


def test_a_down_instance_is_not_chosen_until_marked_up() -> None:
    instances = pool()
    d2 = instances.of_role(Role.DECODE)[1]
    assert instances.mark_down(d2, "ConnectError")
    assert not instances.mark_down(d2, "ConnectError again")  # already down: not a new failure
    assert d2.failures == 1
    assert instances.down() == [d2]
    assert {instances.choose(Role.DECODE).url for _ in range(4)} == {D1, D3}
    instances.mark_up(d2)
    assert instances.down() == []
    assert D2 in {instances.choose(Role.DECODE).url for _ in range(3)}


def test_excluded_instances_are_not_chosen_again() -> None:
    instances = pool()
    first = instances.choose(Role.PREFILL)
    second = instances.choose(Role.PREFILL, exclude=[first])
    assert second is not first
    with pytest.raises(NoInstanceUp):
        instances.choose(Role.PREFILL, exclude=[first, second])


def test_no_instance_up_names_the_role_and_every_instance() -> None:
    instances = pool()
    p1, p2 = instances.of_role(Role.PREFILL)
    when = time.time()
    instances.mark_down(p1, "ConnectError: refused", now=when)
    instances.mark_down(p2, "answered 500", now=when)
    assert not instances.any_up(Role.PREFILL)
    assert instances.any_up(Role.DECODE)
    with pytest.raises(NoInstanceUp) as caught:
        instances.choose(Role.PREFILL)
    message = str(caught.value)
    assert message.startswith("no prefill instance is up (")
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when))
    assert f"{P1} down since {since}: ConnectError: refused" in message
    assert f"{P2} down since {since}: answered 500" in message
    assert caught.value.role is Role.PREFILL


def test_failures_in_a_row_take_an_instance_down_and_one_good_probe_brings_it_back() -> None:
    instances = InstancePool.of([P1], [D1, D2], down_after=3)
    d1 = instances.of_role(Role.DECODE)[0]
    assert not instances.strike(d1, "no answer to a probe within 1 s")
    assert not instances.strike(d1, "no answer to a probe within 1 s")
    instances.mark_up(d1)  # a good probe between: the count starts again
    assert d1.up and d1.strikes == 0
    assert not instances.strike(d1, "timeout")
    assert not instances.strike(d1, "timeout")
    assert d1.up
    assert instances.strike(d1, "timeout")  # the third in a row
    assert not d1.up and d1.failures == 1 and d1.last_error == "timeout"
    assert not instances.strike(d1, "timeout")  # down already: not a new failure
    assert d1.failures == 1
    instances.mark_up(d1)  # half-open: one good probe and it is chosen again
    assert d1.up and d1.strikes == 0
    assert D1 in {instances.choose(Role.DECODE).url for _ in range(2)}


def test_what_waits_on_an_instance_is_told_when_it_goes_down() -> None:
    instances = pool()
    d1 = instances.of_role(Role.DECODE)[0]
    told: list[str] = []
    with instances.watch_down(d1, lambda: told.append("down")):
        instances.strike(d1, "timeout")
        assert told == []
        instances.mark_down(d1, "ConnectError")
        instances.mark_down(d1, "ConnectError again")  # already down: told once
        assert told == ["down"]
    instances.mark_up(d1)
    instances.mark_down(d1, "ConnectError")  # no longer watched
    assert told == ["down"]
    assert not d1.down_watchers


@pytest.mark.parametrize(
    ("verdict", "waiting_cut"),
    [
        (Verdict("/ready answered 503"), False),  # alive: draining or restarting an actor
        (Verdict("no answer to a probe within 1 s", answered=False), True),  # hung, or gone
    ],
)
def test_an_instance_that_still_answers_finishes_what_waits_on_it(
    verdict: Verdict, waiting_cut: bool
) -> None:
    """Probes that fail take an instance out of rotation either way; the streams waiting on it
    are cut (to go elsewhere) only when it stopped answering. An instance answering 503 while
    one of its actors restarts resumes its requests itself: cutting them loses them."""
    instances = pool()
    d1 = instances.of_role(Role.DECODE)[0]
    told: list[bool] = []
    with instances.watch_down(d1, lambda: told.append(True)):
        for _ in range(instances.down_after):
            judge(instances, d1, verdict, at_once=False)
    assert not d1.up and instances.choose(Role.DECODE) is not d1
    assert told == ([True] if waiting_cut else [])
    assert d1.cuts == (1 if waiting_cut else 0)  # what a relayed stream checks between chunks
    judge(instances, d1, Verdict(None), at_once=False)
    assert d1.up


def test_with_none_up_a_request_goes_to_an_instance_that_still_answers() -> None:
    """The only decode instance restarting an actor (its /ready says 503) still takes new
    requests: it queues them and serves them once back. One that stopped answering does not."""
    instances = InstancePool.of([P1], [D1, D2])
    d1, d2 = instances.of_role(Role.DECODE)
    judge(instances, d1, Verdict("/ready answered 503"), at_once=True)
    judge(instances, d2, Verdict("no answer", answered=False), at_once=True)
    assert not d1.up and not d2.up
    assert instances.choose(Role.DECODE) is d1
    with pytest.raises(NoInstanceUp):
        instances.choose(Role.DECODE, exclude=[d1])
    instances.mark_down(d1, "connection refused")  # nothing listens there any more
    with pytest.raises(NoInstanceUp):
        instances.choose(Role.DECODE)
