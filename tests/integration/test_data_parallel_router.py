"""The data-parallel router on a real Gateway (no processes): least pending tokens, each request
counted once, sticky per request, aborts to where the request runs, failover of a dead replica,
a restart resubmitting only its replica's requests (unless probation is under way); and the
merged scheduler report."""

from __future__ import annotations

import pytest

from engine.inflight.registry import Gateway
from engine.inflight.replicas import merge_reports
from engine.inflight.router import LeastPendingRouter, pending_tokens
from engine.messages.outputs import OutputBatch, SampleDeltaText, TextStarted
from engine.messages.params import SamplingParams
from engine.messages.reports import SchedulerReport
from engine.messages.requests import GATEWAY_TO_TOKENIZER, EngineRequest, GenerateRequest
from engine.messages.scheduling import AbortRequests, SchedulerStats

MAX_MODEL_LEN = 1000


@pytest.fixture
def gateway() -> Gateway:
    return Gateway()


def _open(gateway: Gateway, prompt_len: int, max_tokens: int, n: int = 1) -> GenerateRequest:
    params = SamplingParams(max_tokens=max_tokens, n=n)
    _, submission = gateway.register(
        EngineRequest(params=params, prompt_token_ids=list(range(3, 3 + prompt_len)))
    )
    assert submission is not None
    return submission


def _route(router: LeastPendingRouter, *requests: GenerateRequest) -> list[int]:
    """The replica each request went to."""
    frames = [GATEWAY_TO_TOKENIZER.encode(r) for r in requests]
    sent = router.route(frames)
    where = {}
    for replica, parts in sent.items():
        for frame in parts:
            message = GATEWAY_TO_TOKENIZER.decode(frame)
            assert isinstance(message, GenerateRequest)
            where[message.request_id] = replica
    return [where[r.request_id] for r in requests]


def _deliver(gateway: Gateway, request: GenerateRequest, tokens: int, finish: bool = False) -> None:
    started = TextStarted(request.request_id, request.epoch)
    delta = SampleDeltaText(
        request.request_id,
        request.epoch,
        0,
        list(range(tokens)),
        "x" * tokens,
        None,
        "length" if finish else None,
    )
    gateway.deliver(OutputBatch([started], [delta], []))


def test_equal_requests_alternate_between_idle_replicas(gateway: Gateway) -> None:
    router = LeastPendingRouter(2, gateway, MAX_MODEL_LEN)
    requests = [_open(gateway, 10, 20) for _ in range(6)]
    assert _route(router, *requests) == [0, 1, 0, 1, 0, 1]
    assert router.loads() == [90, 90] and router.requests() == [3, 3]


def test_a_long_request_sends_the_next_ones_elsewhere_until_loads_even_out(
    gateway: Gateway,
) -> None:
    router = LeastPendingRouter(2, gateway, MAX_MODEL_LEN)
    long = _open(gateway, 200, 100)  # 300 pending tokens
    short = [_open(gateway, 20, 30) for _ in range(7)]  # 50 each
    placed = _route(router, long, *short)
    assert placed == [0, 1, 1, 1, 1, 1, 1, 0]  # 6 x 50 = 300 on replica 1, then a tie by count
    assert router.loads() == [350, 300]


def test_a_resubmitted_request_is_not_counted_twice(gateway: Gateway) -> None:
    router = LeastPendingRouter(2, gateway, MAX_MODEL_LEN)
    first, second = _open(gateway, 100, 100), _open(gateway, 10, 10)
    assert _route(router, first, second) == [0, 1]
    before = router.loads()
    [again] = [s for s in gateway.resubmit_all() if isinstance(s, GenerateRequest)][:1]
    assert again.request_id == first.request_id and again.epoch == 1
    assert _route(router, again) == [0]  # where it ran, adding nothing
    assert router.loads() == before
    router.invalidate()  # a recount from the gateway's records agrees
    assert router.loads() == before


def test_progress_and_finished_requests_lower_the_load(gateway: Gateway) -> None:
    router = LeastPendingRouter(2, gateway, MAX_MODEL_LEN)
    a, b = _open(gateway, 40, 50), _open(gateway, 40, 50)
    _route(router, a, b)
    _deliver(gateway, a, 10)  # prefill done, 10 of 50 tokens out
    router.invalidate()
    assert router.loads() == [40, 90]
    _deliver(gateway, b, 50, finish=True)
    router.invalidate()
    assert router.loads() == [40, 0] and router.requests() == [1, 0]
    assert _route(router, _open(gateway, 5, 5)) == [1]


def test_pending_tokens_count_every_unfinished_sample_and_text_prompts(gateway: Gateway) -> None:
    record, _ = gateway.register(
        EngineRequest(params=SamplingParams(max_tokens=7, n=3), prompt_token_ids=[5] * 11)
    )
    assert pending_tokens(record, MAX_MODEL_LEN) == 11 + 3 * 7
    text, _ = gateway.register(
        EngineRequest(params=SamplingParams(max_tokens=None), prompt="x" * 400)
    )
    # ~4 characters per token until the tokenizer's count is known; no max_tokens: up to the limit
    assert pending_tokens(text, MAX_MODEL_LEN) == 101 + (MAX_MODEL_LEN - 101)


def test_aborts_go_to_the_replica_that_runs_the_request(gateway: Gateway) -> None:
    router = LeastPendingRouter(2, gateway, MAX_MODEL_LEN)
    a, b = _open(gateway, 10, 10), _open(gateway, 10, 10)
    _route(router, a, b)
    sent = router.route([GATEWAY_TO_TOKENIZER.encode(AbortRequests([b.request_id, a.request_id]))])
    aborts = {
        replica: [GATEWAY_TO_TOKENIZER.decode(frame) for frame in frames]
        for replica, frames in sent.items()
    }
    assert aborts == {1: [AbortRequests([b.request_id])], 0: [AbortRequests([a.request_id])]}


def test_a_dead_replicas_requests_move_to_the_live_ones(gateway: Gateway) -> None:
    router = LeastPendingRouter(3, gateway, MAX_MODEL_LEN)
    requests = [_open(gateway, 10, 10) for _ in range(3)]
    assert _route(router, *requests) == [0, 1, 2]
    assert router.mark_dead(1) == [requests[1].request_id]
    resubmitted = [s for s in gateway.resubmit_all() if isinstance(s, GenerateRequest)]
    assert _route(router, *resubmitted) == [0, 0, 2]  # ties: fewer requests, then the first
    assert _route(router, _open(gateway, 10, 10)) == [2]


def test_merged_report_sums_counts_and_averages_fractions() -> None:
    def report(running: int, usage: float) -> SchedulerReport:
        stats = SchedulerStats(
            num_running=running,
            num_waiting=1,
            num_requests=running + 1,
            kv_usage=usage,
            num_free_blocks=10,
            num_cached_blocks=2,
            prefix_cache_hit_rate=usage,
            num_preemptions=0,
            num_steps=5,
        )
        return SchedulerReport(stats, [])

    merged = merge_reports([report(2, 0.5), report(4, 0.25)]).stats
    assert (merged.num_running, merged.num_waiting, merged.num_free_blocks) == (6, 2, 20)
    assert merged.kv_usage == pytest.approx(0.375)


def test_a_restart_in_one_replica_resubmits_only_its_requests(gateway: Gateway) -> None:
    router = LeastPendingRouter(2, gateway, MAX_MODEL_LEN)
    requests = [_open(gateway, 10, 10) for _ in range(4)]
    assert _route(router, *requests) == [0, 1, 0, 1]
    on_one = router.requests_on({1})
    assert on_one == {requests[1].request_id, requests[3].request_id}
    resubmitted = gateway.resubmit_all(on_one)
    assert [(s.request_id, s.epoch) for s in resubmitted if isinstance(s, GenerateRequest)] == [
        (requests[1].request_id, 1),
        (requests[3].request_id, 1),
    ]
    assert [r.epoch for r in gateway.records()] == [0, 1, 0, 1]  # replica 0's run on
    assert _route(router, *resubmitted) == [1, 1]  # back where they ran


def test_a_dead_replicas_requests_are_the_ones_resubmitted(gateway: Gateway) -> None:
    router = LeastPendingRouter(2, gateway, MAX_MODEL_LEN)
    requests = [_open(gateway, 10, 10) for _ in range(4)]
    _route(router, *requests)
    router.mark_dead(1)
    moved = router.requests_on(set())  # only those routed nowhere now
    assert moved == {requests[1].request_id, requests[3].request_id}
    resubmitted = [s for s in gateway.resubmit_all(moved) if isinstance(s, GenerateRequest)]
    assert _route(router, *resubmitted) == [0, 0]


def test_probation_makes_any_resubmission_engine_wide(gateway: Gateway) -> None:
    router = LeastPendingRouter(2, gateway, MAX_MODEL_LEN)
    requests = [_open(gateway, 10, 10) for _ in range(2)]
    _route(router, *requests)
    gateway.record_crash("worker0-r1", "exited with status 1")  # both were in flight: suspects
    out = gateway.resubmit_all(router.requests_on({1}))
    # One suspect goes alone, the other is held back (aborted where it runs), whichever replica.
    assert [type(message).__name__ for message in out] == ["AbortRequests", "GenerateRequest"]
    assert all(record.epoch == 1 for record in gateway.records())
