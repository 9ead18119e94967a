"""The KV cache outlives a worker's restart and the prefix cache a scheduler's (issue 31, item 7):
the scheduler keeps, or a restarted one rebuilds from the prefix index, exactly the blocks whose
KV came back from a finished step, so a resubmitted request recomputes only its last partial
block, and never reads KV that a step in flight at the death may have left half written.

Driven by the reference worker of test_scheduler.py: it checks every KV read against the
sequence's tokens. Whatever a death may have left behind is modelled as garbage in every block
the scheduler had not indexed.
"""

from __future__ import annotations

from engine.kv.cache.block_pool import BlockPool
from engine.kv.cache.prefix_index import PrefixIndex, prefix_index_bytes
from engine.messages.scheduling import SampleResume
from engine.scheduler import Scheduler, SchedulerConfig
from tests.unit.test_scheduler import (
    Outputs,
    ReferenceWorker,
    assert_no_state_left,
    expected,
    make,
    step,
    submit,
)

PROMPTS = {"a": [1, 2, 3, 4, 5, 6, 7, 8, 9], "b": [1, 2, 3, 4, 5, 6, 7, 8, 10]}
MAX_TOKENS = 12
BLOCK_SIZE = 4  # make()'s


def start(scheduler: Scheduler, worker: ReferenceWorker, steps: int) -> Outputs:
    for request_id, prompt in PROMPTS.items():
        scheduler.add(submit(request_id, prompt, max_tokens=MAX_TOKENS))
    outputs = Outputs()
    for _ in range(steps):
        step(scheduler, worker, outputs)
    return outputs


def survivor(worker: ReferenceWorker, indexed: set[int]) -> ReferenceWorker:
    """A fresh rank on the old KV cache, in which only the indexed blocks are trusted."""
    fresh = ReferenceWorker(BLOCK_SIZE)
    fresh.cache = worker.cache
    for block_id in list(worker.cache):
        if block_id not in indexed:
            worker.cache[block_id] = [-1] * BLOCK_SIZE
    return fresh


def resubmit_and_finish(scheduler: Scheduler, worker: ReferenceWorker, outputs: Outputs) -> None:
    """The gateway's resubmission (epoch 1, the delivered tokens); each resumes from its last
    full block and ends with exactly the undisturbed tokens."""
    full_blocks = []
    for request_id, prompt in PROMPTS.items():
        delivered = list(outputs.tokens[request_id, 0])
        resubmit = submit(request_id, prompt, epoch=1, max_tokens=MAX_TOKENS)
        resubmit.resume = [SampleResume(0, delivered)]
        assert scheduler.add(resubmit) is None
        computed = len(prompt) + len(delivered) - 1  # the last token's KV is not written yet
        full_blocks.append(computed // BLOCK_SIZE * BLOCK_SIZE)
    plan = scheduler.schedule()
    assert plan is not None
    assert [chunk.start_pos for chunk in plan.chunks] == full_blocks
    outputs.add(scheduler.update(worker.run(plan)))
    for _ in range(10 * MAX_TOKENS):  # a bound: a scheduler that never finishes fails, not hangs
        if step(scheduler, worker, outputs) is None:
            break
    else:
        raise AssertionError(f"not finished after {10 * MAX_TOKENS} steps")
    for request_id, prompt in PROMPTS.items():
        assert outputs.tokens[request_id, 0] == expected(prompt, 1, MAX_TOKENS)
    assert_no_state_left(scheduler, worker)


def test_after_a_worker_restart_the_kv_of_steps_that_came_back_is_reused() -> None:
    scheduler, worker = make(kv_outlives_workers=True)
    outputs = start(scheduler, worker, steps=4)
    assert scheduler.schedule() is not None  # the step the workers die in: never indexed
    scheduler.on_workers_restarted()
    scheduler.abort(scheduler.request_ids())  # as the actor does: the gateway resubmits
    indexed = {b for b, key in enumerate(scheduler.kv.pool.block_hashes) if key is not None}
    resubmit_and_finish(scheduler, survivor(worker, indexed), outputs)


def test_a_restarted_scheduler_rebuilds_its_prefix_cache_from_the_index() -> None:
    config = SchedulerConfig(
        num_blocks=64, block_size=BLOCK_SIZE, max_num_batched_tokens=32, max_model_len=64
    )
    record = PrefixIndex(bytearray(prefix_index_bytes(config.num_blocks)), config.num_blocks)
    scheduler = Scheduler(config, prefix_index=record)
    worker = ReferenceWorker(BLOCK_SIZE)
    outputs = start(scheduler, worker, steps=4)
    in_flight = scheduler.schedule()
    assert in_flight is not None
    worker.run(in_flight)  # the workers finish the dead scheduler's step; nobody reads it
    restarted = Scheduler(config, first_id=1 << 40, prefix_index=record)
    indexed = {block_id for block_id, _ in record.entries()}
    assert restarted.kv.pool.num_cached_free_blocks == len(indexed) > 0
    resubmit_and_finish(restarted, survivor(worker, indexed), outputs)


def test_the_index_follows_evictions_and_a_forgotten_cache() -> None:
    record = PrefixIndex(bytearray(prefix_index_bytes(2)), 2)
    pool = BlockPool(2, record)
    first, second = pool.allocate(2)
    pool.register(first, b"a" * 16)
    pool.register(second, b"b" * 16)
    pool.release([second, first])
    assert dict(record.entries()) == {first: b"a" * 16, second: b"b" * 16}
    pool.allocate(1)  # evicts the least recently freed: `second`
    assert dict(record.entries()) == {first: b"a" * 16}
    assert BlockPool(2, record).lookup(b"a" * 16) == first
    pool.clear_cache()  # the workers' KV is gone (a GPU's): nothing may be found again
    assert list(record.entries()) == []
