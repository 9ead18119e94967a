"""The P/D proxy's instance choice and marking (no servers): least outstanding requests, turns
among equals, down instances never chosen, and a 503 message that names each instance."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from engine.http.proxy_pool import InstancePool, NoInstanceUp, Role

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
