"""P/D at the scheduler level: a prefill scheduler hands a request off with its KV held, a decode
scheduler pulls what its prefix cache lacks and computes only the rest.

Two schedulers, each with the reference worker of test_scheduler (which checks that every token
it samples from reads exactly the request's history from the KV blocks named in the plan). A
"transfer" copies the reference cache's blocks from the prefill side to the decode side, as the
kv_transfer actors copy real KV, so a block pulled into the wrong place, indexed under the wrong
prefix or freed while in use shows up as a wrong read or a broken pool invariant."""

from __future__ import annotations

import msgspec
import pytest

from engine.messages.kv_transfer import (
    BlocksPulled,
    BlocksReleased,
    DropHolds,
    HoldBlocks,
    KvEndpoint,
    KvLayout,
    PullBlocks,
    TransferEndpoint,
)
from engine.messages.scheduling import SampleResume, SubmitRequest
from engine.scheduler import Scheduler
from engine.scheduler.kv_pulls import PULL_GRACE_S
from engine.scheduler.kv_tally import Outcome, RankTally
from tests.unit.test_scheduler import Outputs, ReferenceWorker, expected, make, step, submit

RANKS = 2
BLOCK = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def layout(rank: int = 0) -> KvLayout:
    return KvLayout("m", 2, 1, 8, BLOCK, "float32", 4, RANKS, rank, 64)


def instance(clock: Clock, num_blocks: int = 64) -> tuple[Scheduler, ReferenceWorker]:
    scheduler, worker = make(num_blocks, kv_transfer_ranks=RANKS, kv_hold_timeout=10.0)
    scheduler.clock = clock
    assert scheduler.kv_transfer is not None
    scheduler.kv_transfer.holds._clock = clock
    scheduler.kv_transfer.pulls._clock = clock
    for rank in range(RANKS):
        endpoint = KvEndpoint("127.0.0.1", 9000 + rank, "host")
        scheduler.kv_transfer.on_event(TransferEndpoint(rank, endpoint, layout(rank)))
    return scheduler, worker


def orders(scheduler: Scheduler) -> list[object]:
    assert scheduler.kv_transfer is not None
    return list(scheduler.kv_transfer.take_orders())


def prefill_and_hand_off(prefill: Scheduler, worker: ReferenceWorker, request: SubmitRequest):
    """Run the prefill side until the request is handed off; its first token and source."""
    assert prefill.add(request) is None
    outputs = Outputs()
    for _ in range(50):
        plan = prefill.schedule()
        assert plan is not None
        result = worker.run(plan)
        batch = prefill.update(result)
        outputs.add(batch)
        handoffs = [item for item in batch.items if item.handoff is not None]
        if handoffs:
            (item,) = handoffs
            assert item.finish_reason is None
            return item.new_token_ids, item.handoff
    raise AssertionError("no handoff")


def transfer(src: ReferenceWorker, dst: ReferenceWorker, pull: PullBlocks) -> None:
    for src_block, dst_block in zip(pull.src_block_ids, pull.dst_block_ids, strict=True):
        dst.cache[dst_block] = list(src.cache[src_block])


def decode_to_end(decode: Scheduler, worker: ReferenceWorker) -> tuple[Outputs, list[int]]:
    """Run the decode side to the end; its outputs and the first chunk's start position."""
    outputs = Outputs()
    starts = []
    for _ in range(200):
        plan = step(decode, worker, outputs)
        if plan is not None and plan.chunks and not starts:
            starts.append(plan.chunks[0].start_pos)
        if plan is None and not decode.has_unfinished_requests:
            return outputs, starts
    raise AssertionError("decode did not finish")


PROMPT = list(range(1, 15))  # 14 tokens: 3 full blocks of 4 and a partial one


def handed_off(clock: Clock, **params: object):
    prefill, p_worker = instance(clock)
    request = msgspec.structs.replace(
        submit("a", PROMPT, seed=5, max_tokens=6, **params), kv_handoff="continue"
    )
    first, source = prefill_and_hand_off(prefill, p_worker, request)
    return prefill, p_worker, first, source


def decode_request(first: list[int], source, **params: object) -> SubmitRequest:
    request = submit("a", PROMPT, epoch=1, seed=5, max_tokens=6, **params)
    return msgspec.structs.replace(request, resume=[SampleResume(0, first)], kv_source=source)


def pending_pull(clock: Clock) -> tuple[Scheduler, ReferenceWorker, list[int], PullBlocks]:
    """A decode scheduler whose request "a" waits for its KV; its worker, the first token (from
    the prefill side) and the pull it ordered."""
    _, _, first, source = handed_off(clock)
    decode, worker = instance(clock)
    decode.add(decode_request(first, source))
    (pull,) = orders(decode)
    assert isinstance(pull, PullBlocks) and decode.kv_transfer is not None
    return decode, worker, first, pull


# ---- the tally -------------------------------------------------------------------------------


def test_a_transfer_is_done_only_when_every_rank_reported_success() -> None:
    tally = RankTally(3)
    assert tally.record(0) is None
    assert tally.record(0) is None  # a repeat counts once
    assert tally.record(7) is None  # no such rank
    assert tally.record(2) is None
    assert tally.record(1) is Outcome.DONE
    assert tally.all_reported


def test_one_failing_rank_fails_the_transfer_at_once_and_the_rest_still_report() -> None:
    tally = RankTally(2)
    assert tally.record(1, "peer vanished") is Outcome.FAILED
    assert not tally.all_reported  # rank 0 may still be writing
    assert tally.record(0) is Outcome.FAILED
    assert tally.all_reported and tally.first_error() == "peer vanished"


# ---- prefill side ----------------------------------------------------------------------------


def test_the_prefill_side_hands_off_after_the_first_token_holding_the_full_prompt_blocks() -> None:
    clock = Clock()
    prefill, _, first, source = handed_off(clock)
    assert len(first) == 1
    assert source.num_tokens == 12 and len(source.block_ids) == 3  # the partial block stays
    assert [e.port for e in source.endpoints] == [9000, 9001]
    assert not prefill.has_unfinished_requests  # the request left this instance...
    pool = prefill.kv.pool
    assert all(pool.ref_counts[b] == 1 for b in source.block_ids)  # ... its blocks did not
    (hold,) = [o for o in orders(prefill) if isinstance(o, HoldBlocks)]
    assert hold.block_ids == source.block_ids and hold.transfer_id == source.transfer_id
    assert prefill.stats().kv_holds == 1


def test_a_hold_ends_when_every_rank_reports_the_acknowledgement() -> None:
    clock = Clock()
    prefill, _, _, source = handed_off(clock)
    assert prefill.kv_transfer is not None
    prefill.kv_transfer.on_event(BlocksReleased(source.transfer_id, 0))
    assert prefill.kv.pool.ref_counts[source.block_ids[0]] == 1  # rank 1 has not said so yet
    prefill.kv_transfer.on_event(BlocksReleased(source.transfer_id, 1))
    assert all(prefill.kv.pool.ref_counts[b] == 0 for b in source.block_ids)
    assert prefill.kv.num_free_blocks == prefill.config.num_blocks
    prefill.kv.pool.check_invariants()


def test_the_hold_timeout_frees_the_blocks_and_tells_the_ranks() -> None:
    clock = Clock()
    prefill, _, _, source = handed_off(clock)
    assert prefill.kv_transfer is not None
    orders(prefill)
    clock.now += 9.9
    prefill.kv_transfer.tick()
    assert prefill.stats().kv_holds == 1
    clock.now += 0.2
    prefill.kv_transfer.tick()
    assert prefill.kv.num_free_blocks == prefill.config.num_blocks
    assert orders(prefill) == [DropHolds([source.transfer_id])]
    assert prefill.stats().kv_holds_expired == 1


def test_no_handoff_before_every_rank_announced_itself_the_request_runs_here() -> None:
    scheduler, worker = make(64, kv_transfer_ranks=RANKS)
    request = msgspec.structs.replace(submit("a", PROMPT, max_tokens=5), kv_handoff="continue")
    scheduler.add(request)
    outputs = Outputs()
    for _ in range(50):
        step(scheduler, worker, outputs)
    assert outputs.tokens[("a", 0)] == expected(PROMPT, 1, 5)
    assert outputs.finish[("a", 0)] == "length"


def test_a_request_whose_first_token_ends_it_is_not_handed_off() -> None:
    clock = Clock()
    prefill, worker = instance(clock)
    request = msgspec.structs.replace(submit("a", PROMPT, max_tokens=1), kv_handoff="continue")
    prefill.add(request)
    outputs = Outputs()
    for _ in range(10):
        step(prefill, worker, outputs)
    assert outputs.finish[("a", 0)] == "length"
    assert prefill.stats().kv_handoffs == 0 and prefill.kv.pool.usage == 0


# ---- decode side -----------------------------------------------------------------------------


def test_the_decode_side_pulls_the_blocks_then_computes_only_the_tail_and_continues() -> None:
    clock = Clock()
    _, p_worker, first, source = handed_off(clock)
    decode, d_worker = instance(clock)
    assert decode.add(decode_request(first, source)) is None
    assert decode.schedule() is None  # waits for its KV
    (pull,) = orders(decode)
    assert isinstance(pull, PullBlocks)
    assert pull.src_block_ids == source.block_ids and len(pull.dst_block_ids) == 3
    transfer(p_worker, d_worker, pull)
    assert decode.kv_transfer is not None
    assert decode.kv_transfer.on_event(BlocksPulled(pull.transfer_id, 0, None, 100, 0.1)) == []
    ready = decode.kv_transfer.on_event(BlocksPulled(pull.transfer_id, 1, None, 100, 0.2))
    assert decode.admit_pulled(ready) == []
    outputs, starts = decode_to_end(decode, d_worker)
    assert starts == [12]  # the 3 pulled blocks were a cached prefix: only the tail ran
    assert first + outputs.tokens[("a", 0)] == expected(PROMPT, 5, 6)
    stats = decode.stats()
    assert (stats.kv_pulls, stats.kv_blocks_pulled, stats.kv_fallbacks) == (1, 3, 0)
    assert stats.kv_bytes_pulled == 200 and stats.kv_pull_seconds == pytest.approx(0.2)
    assert decode.kv.pool.usage == 0


def pull_after_a_shared_prefix(clock: Clock, shared_tokens: int):  # type: ignore[no-untyped-def]
    """The pull ordered for request "a" on a decode side where an earlier request had computed
    the prompt's first `shared_tokens` tokens; the scheduler, its worker, the first token, the
    source and the pull."""
    _, _, first, source = handed_off(clock)
    decode, worker = instance(clock)
    decode.add(submit("earlier", [*PROMPT[:shared_tokens], 90, 91], max_tokens=1))
    decode_to_end(decode, worker)
    decode.add(decode_request(first, source))
    (pull,) = orders(decode)
    assert isinstance(pull, PullBlocks)
    return decode, worker, first, source, pull


def test_the_decode_side_pulls_only_the_blocks_its_prefix_cache_lacks() -> None:
    # The earlier request shared the first two blocks of the prompt (8 tokens).
    decode, _, _, source, pull = pull_after_a_shared_prefix(Clock(), 8)
    assert pull.src_block_ids == source.block_ids[2:]
    assert decode.stats().kv_blocks_from_cache == 2


def test_a_failed_rank_falls_back_to_local_prefill_and_the_blocks_wait_for_the_other_rank() -> None:
    clock = Clock()
    decode, d_worker, first, pull = pending_pull(clock)
    ready = decode.kv_transfer.on_event(BlocksPulled(pull.transfer_id, 1, "connection refused"))
    decode.admit_pulled(ready)
    outputs = Outputs()
    plan = step(decode, d_worker, outputs)
    assert plan is not None and plan.chunks[0].start_pos == 0  # computes the prompt itself
    used = set(plan.chunks[0].new_block_ids)
    assert not used & set(pull.dst_block_ids)  # rank 0 may still write into those
    decode.kv_transfer.on_event(BlocksPulled(pull.transfer_id, 0, None, 100, 0.1))
    outputs_rest, _ = decode_to_end(decode, d_worker)
    tokens = first + outputs.tokens[("a", 0)] + outputs_rest.tokens[("a", 0)]
    assert tokens == expected(PROMPT, 5, 6)
    assert decode.stats().kv_fallbacks == 1
    assert decode.kv.num_free_blocks == decode.config.num_blocks


def test_a_pull_past_its_deadline_falls_back_and_frees_its_blocks_after_the_grace() -> None:
    clock = Clock()
    decode, d_worker, first, pull = pending_pull(clock)
    clock.now += 10.0
    assert decode.admit_pulled(decode.kv_transfer.tick()) == []
    outputs, starts = decode_to_end(decode, d_worker)
    assert starts == [0] and first + outputs.tokens[("a", 0)] == expected(PROMPT, 5, 6)
    assert decode.kv.pool.ref_counts[pull.dst_block_ids[0]] == 1  # not reused yet
    clock.now += PULL_GRACE_S
    decode.kv_transfer.tick()
    assert decode.kv.num_free_blocks == decode.config.num_blocks


def test_a_restarted_kv_transfer_rank_fails_the_pulls_in_flight() -> None:
    decode, _, _, _ = pending_pull(Clock())
    again = TransferEndpoint(0, KvEndpoint("127.0.0.1", 9100, "host"), layout(0))
    (ready,) = decode.kv_transfer.on_event(again)
    assert ready.request_id == "a"
    assert decode.stats().kv_fallbacks == 1


def test_an_aborted_request_is_never_admitted_and_its_blocks_free_once_the_ranks_report() -> None:
    decode, _, _, pull = pending_pull(Clock())
    decode.abort(["a"])
    assert not decode.has_unfinished_requests
    for rank in range(RANKS):
        assert decode.kv_transfer.on_event(BlocksPulled(pull.transfer_id, rank, None)) == []
    assert decode.kv.num_free_blocks == decode.config.num_blocks
    assert decode.schedule() is None


def test_pulled_blocks_from_before_a_worker_restart_are_never_indexed() -> None:
    decode, _, _, pull = pending_pull(Clock())
    decode.on_workers_restarted()
    decode.abort(decode.request_ids())
    for rank in range(RANKS):
        assert decode.kv_transfer.on_event(BlocksPulled(pull.transfer_id, rank, None)) == []
    assert decode.kv.pool.hash_to_block == {}
    assert decode.kv.num_free_blocks == decode.config.num_blocks


def test_a_prompt_shorter_than_a_block_is_handed_off_without_a_hold_or_a_pull() -> None:
    clock = Clock()
    prefill, p_worker = instance(clock)
    short = [5, 6, 7]
    request = msgspec.structs.replace(
        submit("s", short, seed=5, max_tokens=4), kv_handoff="continue"
    )
    first, source = prefill_and_hand_off(prefill, p_worker, request)
    assert source.block_ids == [] and prefill.stats().kv_holds == 0
    assert not [o for o in orders(prefill) if isinstance(o, HoldBlocks)]
    decode, d_worker = instance(clock)
    resumed = submit("s", short, epoch=1, seed=5, max_tokens=4)
    decode.add(msgspec.structs.replace(resumed, resume=[SampleResume(0, first)], kv_source=source))
    assert orders(decode) == []
    outputs, starts = decode_to_end(decode, d_worker)
    assert starts == [0] and first + outputs.tokens[("s", 0)] == expected(short, 5, 4)


def test_with_every_block_cached_the_pull_moves_nothing_but_still_acknowledges() -> None:
    decode, d_worker, first, _, pull = pull_after_a_shared_prefix(Clock(), 12)
    assert pull.src_block_ids == pull.dst_block_ids == []
    assert decode.kv_transfer is not None
    for rank in range(RANKS):
        ready = decode.kv_transfer.on_event(BlocksPulled(pull.transfer_id, rank, None))
    assert decode.admit_pulled(ready) == []
    outputs, starts = decode_to_end(decode, d_worker)
    assert starts == [12] and first + outputs.tokens[("a", 0)] == expected(PROMPT, 5, 6)


def test_a_source_of_another_layout_is_not_pulled_the_request_computes_its_prompt() -> None:
    clock = Clock()
    _, _, first, source = handed_off(clock)
    decode, d_worker = instance(clock)
    other = msgspec.structs.replace(
        source, layout=msgspec.structs.replace(source.layout, dtype="bfloat16")
    )
    decode.add(decode_request(first, other))
    assert orders(decode) == []
    outputs, starts = decode_to_end(decode, d_worker)
    assert starts == [0] and first + outputs.tokens[("a", 0)] == expected(PROMPT, 5, 6)
    assert decode.stats().kv_fallbacks == 1


def test_the_same_transfer_submitted_again_while_pulled_computes_instead() -> None:
    clock = Clock()
    decode, d_worker, first, pull = pending_pull(clock)
    again = msgspec.structs.replace(decode_request(first, pull.source), epoch=2)
    decode.add(again)  # the first is cancelled but its blocks are still being written
    assert orders(decode) == []
    assert decode.kv.pool.ref_counts[pull.dst_block_ids[0]] == 1
    outputs, starts = decode_to_end(decode, d_worker)
    assert starts == [0] and first + outputs.tokens[("a", 0)] == expected(PROMPT, 5, 6)
    assert decode.kv_transfer is not None
    for rank in range(RANKS):
        decode.kv_transfer.on_event(BlocksPulled(pull.transfer_id, rank, None))
    assert decode.kv.num_free_blocks == decode.config.num_blocks


# ---- what a client cannot choose -------------------------------------------------------------


def test_transfer_ids_are_random_128_bits_whatever_the_request_id() -> None:
    clock = Clock()
    ids = {handed_off(clock)[3].transfer_id for _ in range(3)}  # request "a", epoch 0 each time
    assert len(ids) == 3
    assert all(len(tid) == 32 and int(tid, 16) >= 0 for tid in ids)  # 128 bits, hex


def test_another_prompts_kv_is_never_pulled_into_this_prompts_prefix() -> None:
    clock = Clock()
    _, _, first, source = handed_off(clock)
    decode, d_worker = instance(clock)
    other = [t + 100 for t in PROMPT]  # same length, other tokens: the source's blocks are not its
    request = msgspec.structs.replace(
        submit("a", other, epoch=1, seed=5, max_tokens=6),
        resume=[SampleResume(0, first)],
        kv_source=source,
    )
    decode.add(request)

    assert orders(decode) == []  # nothing pulled
    _, starts = decode_to_end(decode, d_worker)
    assert starts == [0]  # it computed its own prompt
    assert decode.stats().kv_fallbacks == 1 and decode.stats().kv_pulls == 0


def test_held_blocks_stop_at_half_the_pool_and_normal_requests_still_run() -> None:
    """Unpulled holds (anyone may ask a prefill instance for one) never take more than half the
    KV pool: past it a handoff holds nothing and its puller computes the prompt itself."""
    clock = Clock()
    prefill, worker = instance(clock, num_blocks=16)  # holds may take 8 blocks
    prompt = list(range(1, 13))  # 3 full blocks each
    sources = []
    for i in range(3):
        request = msgspec.structs.replace(
            submit(f"h{i}", prompt, seed=i, max_tokens=4), kv_handoff="continue"
        )
        sources.append(prefill_and_hand_off(prefill, worker, request)[1])
    assert [len(s.block_ids) for s in sources] == [3, 3, 0]
    stats = prefill.stats()
    assert (stats.kv_holds, stats.kv_holds_refused) == (2, 1)
    outputs = Outputs()  # a request of its own is still admitted and served beside the holds
    assert prefill.add(submit("plain", prompt, seed=9, max_tokens=4)) is None
    while prefill.has_unfinished_requests:
        step(prefill, worker, outputs)
    assert outputs.tokens[("plain", 0)] == expected(prompt, 9, 4)
    assert prefill.kv_transfer is not None  # an acknowledged hold makes room for the next
    for rank in range(RANKS):
        prefill.kv_transfer.on_event(BlocksReleased(sources[0].transfer_id, rank))
    request = msgspec.structs.replace(
        submit("h3", prompt, seed=3, max_tokens=4), kv_handoff="continue"
    )
    assert len(prefill_and_hand_off(prefill, worker, request)[1].block_ids) == 3
    prefill.kv.pool.check_invariants()
