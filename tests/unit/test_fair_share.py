"""Tenants in the scheduler: fair share of each step's tokens by weight, priority, and prefix
caching scoped by tenant, driven step by step by the reference worker of test_scheduler.py.

Shares are counted in tokens the scheduler planned (its own per-tenant tally), over a window
of steps: nothing here depends on time.
"""

from __future__ import annotations

import random

import pytest

from engine.messages.params import SamplingParams
from engine.messages.scheduling import SubmitRequest, TenantTag
from engine.scheduler import Scheduler
from engine.scheduler.fair_share import FairShare, water_fill
from tests.unit.test_scheduler import Outputs, ReferenceWorker, expected, make, step


def tagged(
    request_id: str,
    prompt: list[int],
    tenant: TenantTag | None,
    *,
    priority: int = 0,
    cache_salt: str | None = None,
    seed: int = 1,
    **params: object,
) -> SubmitRequest:
    sampling = SamplingParams(**params)  # type: ignore[arg-type]
    return SubmitRequest(
        request_id,
        0,
        prompt,
        sampling,
        seed,
        tenant=tenant,
        priority=priority,
        cache_salt=cache_salt,
    )


ALICE = TenantTag("alice", 3.0, "alice")
BOB = TenantTag("bob", 1.0, "bob")
EVE = TenantTag("eve", 1.0, "eve")


# ---- the split --------------------------------------------------------------------------------


def test_water_filling_serves_small_demands_whole_and_splits_the_rest_by_weight() -> None:
    weights = {"a": 1.0, "b": 1.0, "c": 2.0}
    shares = water_fill({"a": 10, "b": 500, "c": 500}, weights, 100)
    assert shares == pytest.approx({"a": 10, "b": 30, "c": 60})
    assert water_fill({"a": 1, "b": 1}, {"a": 1.0, "b": 5.0}, 100) == {"a": 1, "b": 1}


def test_a_lone_tenant_gets_the_whole_step_and_idle_tenants_bank_nothing() -> None:
    share = FairShare()
    assert share.grants({"a": 5000}, {"a": 1.0}, 2048) == {"a": 2048}
    for _ in range(7):  # "b" gets its 1/4 of 7 tokens, a fraction each step
        share.grants({"a": 100, "b": 100}, {"a": 3.0, "b": 1.0}, 7)
    assert share.grants({"a": 100}, {"a": 3.0}, 7) == {"a": 7}
    # Back after idling, "b" starts from nothing owed: its share, rounded, no more.
    assert share.grants({"a": 100, "b": 100}, {"a": 3.0, "b": 1.0}, 8) == {"a": 6, "b": 2}


def test_grants_sum_to_the_step_and_their_remainders_carry_to_an_exact_long_run_share() -> None:
    share = FairShare()
    totals = {"a": 0, "b": 0, "c": 0}
    weights = {"a": 3.0, "b": 1.0, "c": 0.5}
    for _ in range(450):
        grants = share.grants({"a": 50, "b": 50, "c": 50}, weights, 7)
        assert sum(grants.values()) == 7
        for tenant, tokens in grants.items():
            totals[tenant] += tokens
    # 7 tokens a step by 3 : 1 : 0.5 over 450 steps: 2100, 700 and 350, to a token.
    assert abs(totals["a"] - 2100) <= 1 and abs(totals["b"] - 700) <= 1
    assert sum(totals.values()) == 450 * 7


# ---- the scheduler ----------------------------------------------------------------------------


def test_weights_3_to_1_share_the_decode_tokens_3_to_1_and_every_token_is_exact() -> None:
    # 16 decoding requests each, a budget of 8 tokens: decodes outnumber the step 4 to 1.
    scheduler, worker = make(
        num_blocks=512, max_num_seqs=64, max_num_batched_tokens=8, max_model_len=64
    )
    outputs = Outputs()
    for i in range(16):
        for tenant in (ALICE, BOB):
            request = tagged(f"{tenant.name}{i}", [i + 1, 2, 3], tenant, max_tokens=40, seed=i)
            scheduler.add(request)
    for _ in range(20):  # both tenants decoding: 8 tokens a step cannot serve them all
        step(scheduler, worker, outputs)
    tally = scheduler.planner.tally
    before = (dict(tally.prompt_tokens), dict(tally.output_tokens))
    for _ in range(40):
        step(scheduler, worker, outputs)
    ran = {
        name: (
            tally.prompt_tokens[name] - before[0][name],
            tally.output_tokens[name] - before[1][name],
        )
        for name in ("alice", "bob")
    }
    assert sum(map(sum, ran.values())) == 8 * 40  # every step full
    assert abs(ran["alice"][1] / ran["bob"][1] - 3.0) <= 0.3, ran
    while step(scheduler, worker, outputs) is not None:
        pass
    for i in range(16):
        for tenant in ("alice", "bob"):
            assert outputs.tokens[f"{tenant}{i}", 0] == expected([i + 1, 2, 3], i, 40)


def first_token_step(scheduler: Scheduler, worker: ReferenceWorker, request_id: str) -> int:
    """Steps until `request_id` has its first token."""
    outputs = Outputs()
    for steps in range(1, 200):
        step(scheduler, worker, outputs)
        if outputs.tokens[request_id, 0]:
            return steps
    raise AssertionError(f"{request_id} got no token in 200 steps")


@pytest.mark.parametrize(("flooder", "max_num_seqs"), [(EVE, 32), (EVE, 4), (BOB, 32)])
def test_a_quiet_tenant_beside_a_flooder_is_prefilled_at_once(
    flooder: TenantTag, max_num_seqs: int
) -> None:
    """16 long prompts of the flooder fill the queue (more of them than there are free slots,
    with 4); the quiet tenant's prompt, sent after them, runs in the next step with half the
    budget (weights 1:1). Sent by the same tenant as the flood, it waits its turn behind all of
    them."""
    quiet = BOB
    scheduler, worker = make(
        num_blocks=1024, max_num_seqs=max_num_seqs, max_num_batched_tokens=32, max_model_len=64
    )
    for i in range(16):
        scheduler.add(tagged(f"flood{i}", [i + 1] * 60, flooder, max_tokens=2))
    step(scheduler, worker, Outputs())
    scheduler.add(tagged("quiet", list(range(1, 31)), quiet, max_tokens=2))
    steps = first_token_step(scheduler, worker, "quiet")
    if flooder is quiet:
        assert steps > 16  # behind 16 x 60 prompt tokens, 32 a step
    else:
        assert steps == 2  # 30 tokens: 16, then 14
        tally = scheduler.planner.tally
        assert tally.prompt_tokens["bob"] == 30
        assert tally.prompt_tokens["eve"] == 3 * 32 - 30  # the rest of each step


def test_a_tenant_alone_plans_exactly_as_without_tenants() -> None:
    plans = []
    for tenant in (None, ALICE):
        scheduler, worker = make(
            num_blocks=12, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=40
        )
        outputs = Outputs()
        for i in range(6):
            scheduler.add(tagged(f"r{i}", [i + 1] * (5 + i), tenant, max_tokens=9, seed=i))
        chunks = []
        while (plan := step(scheduler, worker, outputs)) is not None:
            chunks.append([(c.seq_id, c.start_pos, c.num_tokens) for c in plan.chunks])
        plans.append(chunks)
    assert plans[0] == plans[1]


def test_a_more_urgent_request_jumps_the_queue_and_preempts_a_less_urgent_one() -> None:
    scheduler, worker = make(num_blocks=64, max_num_seqs=2, max_num_batched_tokens=64)
    outputs = Outputs()
    for i in range(4):  # two run, two wait
        scheduler.add(tagged(f"r{i}", [i + 1] * 5, ALICE, priority=5, max_tokens=30, seed=i))
    step(scheduler, worker, outputs)
    scheduler.add(tagged("urgent", [9] * 5, BOB, priority=-1, max_tokens=3, seed=9))
    plan = step(scheduler, worker, outputs)
    assert plan is not None
    assert scheduler.stats().num_preemptions == 1  # a slot for it
    assert outputs.tokens["urgent", 0]  # prefilled in the very next step
    assert scheduler.planner.tally.preemptions["alice"] == 1
    while step(scheduler, worker, outputs) is not None:
        pass
    assert outputs.tokens["urgent", 0] == expected([9] * 5, 9, 3)
    for i in range(4):
        assert outputs.tokens[f"r{i}", 0] == expected([i + 1] * 5, i, 30)


def test_equal_priorities_never_preempt_for_a_slot() -> None:
    scheduler, worker = make(num_blocks=64, max_num_seqs=2, max_num_batched_tokens=64)
    outputs = Outputs()
    for i in range(3):
        scheduler.add(tagged(f"r{i}", [i + 1] * 5, ALICE, max_tokens=5))
    for _ in range(3):
        step(scheduler, worker, outputs)
    assert scheduler.stats().num_preemptions == 0
    assert not outputs.tokens["r2", 0]


def cached_tokens(scheduler: Scheduler, worker: ReferenceWorker, submit: SubmitRequest) -> int:
    """Prompt tokens `submit` found in the prefix cache."""
    before = scheduler.kv.prefix_stats.hit_tokens
    scheduler.add(submit)
    while step(scheduler, worker, Outputs()) is not None:
        pass
    return scheduler.kv.prefix_stats.hit_tokens - before


@pytest.mark.parametrize(
    ("second", "shared"),
    [
        ((ALICE, None), True),
        ((BOB, None), False),
        ((TenantTag("bob", 1.0, "alice"), None), True),  # the tenants file shares their scope
        ((ALICE, "salt"), False),
        ((None, None), False),
    ],
)
def test_the_prefix_cache_is_shared_only_within_one_scope_and_salt(
    second: tuple[TenantTag | None, str | None], shared: bool
) -> None:
    scheduler, worker = make()
    prompt = list(range(1, 14))  # three full blocks of 4
    first = cached_tokens(scheduler, worker, tagged("first", prompt, ALICE, max_tokens=1))
    tenant, salt = second
    hits = cached_tokens(
        scheduler, worker, tagged("second", prompt, tenant, cache_salt=salt, max_tokens=1)
    )
    assert first == 0
    assert hits == (12 if shared else 0)


@pytest.mark.parametrize("trial", range(6))
def test_random_tenants_and_priorities_produce_exactly_the_reference_tokens(trial: int) -> None:
    rng = random.Random(trial)
    scheduler, worker = make(
        num_blocks=rng.choice([12, 16, 40]),
        max_num_seqs=rng.choice([2, 4, 8]),
        max_num_batched_tokens=rng.choice([8, 16, 64]),
        max_model_len=40,
    )
    tenants = [ALICE, BOB, EVE, None]
    wanted: dict[tuple[str, int], list[int]] = {}
    outputs = Outputs()
    for number in range(14):
        prompt = [rng.randint(1, 9) for _ in range(rng.randint(1, 14))]
        max_tokens = rng.randint(1, 15)
        n = rng.choice([1, 1, 2])
        tenant, priority = rng.choice(tenants), rng.choice([0, 0, 1, -1])
        request = tagged(
            f"r{number}", prompt, tenant, priority=priority, seed=number, n=n, max_tokens=max_tokens
        )
        scheduler.add(request)
        for index in range(n):
            wanted[request.request_id, index] = expected(
                prompt, number, max_tokens, 40, index=index
            )
        for _ in range(rng.randint(0, 3)):
            step(scheduler, worker, outputs)
    while step(scheduler, worker, outputs) is not None:
        pass
    for key, tokens in wanted.items():
        assert outputs.tokens[key] == tokens, key
    assert scheduler.stats().num_requests == 0
