"""The prefix cache's disk tier seen from the scheduler (engine/scheduler/disk_tier.py), with the
real store and mover (engine/kv/disk/) on a real cache segment's layout: every full block the
prefix cache indexes is written; a request whose prefix is on disk waits while it is read back,
others run; it then computes only what no tier had, and its tokens are exact.

The reference worker of test_scheduler.py keeps its "KV" (a token id per slot) in a byte buffer
laid out as a one-layer KV cache of int64 slots, which the mover copies to and from files as it
copies a real rank's cache; the worker checks every KV it reads against the sequence's tokens, so
a block read wrong, or into the wrong place, or too early, fails the test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from engine.kv.cache.prefix_cache import BlockHashChain
from engine.kv.disk.mover import DiskMover
from engine.kv.disk.orders import LoadBlocks, SpillBlocks
from engine.kv.disk.store import DiskStore
from engine.kv.transfer.cache_view import CacheView
from engine.messages.kv_transfer import KvLayout
from engine.scheduler import Scheduler, SchedulerConfig
from tests.unit.test_scheduler import (
    EOS,
    Outputs,
    ReferenceWorker,
    assert_no_state_left,
    expected,
    step,
    submit,
)

BLOCK_SIZE = 4
NAMESPACE = b"n" * 16


class SlotBlocks:
    """`cache[block][offset]` over an int64 array of [blocks * block_size] slots (the K half of
    a one-layer cache), as ReferenceWorker indexes its dict."""

    def __init__(self, slots: np.ndarray, block_size: int) -> None:
        self.slots = slots
        self.block_size = block_size

    def __getitem__(self, block: int) -> np.ndarray:
        return self.slots[block * self.block_size : (block + 1) * self.block_size]

    def __iter__(self) -> Any:
        return iter(range(len(self.slots) // self.block_size))


class Engine:
    """A scheduler, a reference worker on a byte cache, and the tier's mover, driven by hand."""

    def __init__(self, tier: Path, num_blocks: int, buffer: bytearray | None = None) -> None:
        layout = KvLayout("ref", 1, 1, 1, BLOCK_SIZE, "int64", 8, 1, 0, num_blocks)
        self.buffer = buffer if buffer is not None else bytearray(layout.segment_bytes)
        slots = np.frombuffer(self.buffer, dtype=np.int64).reshape(1, 2, -1)[0, 0]
        slots[:] = -1  # whatever was there before: never a token
        self.store = DiskStore(str(tier), NAMESPACE, 1 << 30)
        views = [CacheView(layout, self.buffer)]
        self.mover = DiskMover(self.store, views, lambda event: None)
        self.mover.close()  # its thread ends: orders are run here, one at a time, as told
        config = SchedulerConfig(
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            max_num_seqs=8,
            max_num_batched_tokens=32,
            max_model_len=64,
            eos_token_ids=[EOS],
        )
        self.scheduler = Scheduler(config, on_disk=self.store.contains)
        self.worker = ReferenceWorker(BLOCK_SIZE)
        self.worker.cache = SlotBlocks(slots, BLOCK_SIZE)  # type: ignore[assignment]
        self.outputs = Outputs()
        self.orders: list[Any] = []

    def step(self) -> Any:
        plan = step(self.scheduler, self.worker, self.outputs)
        self.orders += self.scheduler.take_disk_orders()
        return plan

    def move(self, kind: type | None = None) -> int:
        """Carry out the disk orders given so far (of `kind`); how many there were."""
        todo = [o for o in self.orders if kind is None or isinstance(o, kind)]
        self.orders = [o for o in self.orders if o not in todo]
        for order in todo:
            failures = self.scheduler.on_disk_event(self.mover.run(order))
            assert failures == []
        self.orders += self.scheduler.take_disk_orders()
        return len(todo)

    def run(self, max_steps: int = 500) -> Outputs:
        for _ in range(max_steps):
            plan = self.step()
            moved = self.move()
            if plan is None and not moved and not self.scheduler.has_unfinished_requests:
                return self.outputs
        raise AssertionError(f"not done after {max_steps} steps")

    def add(self, request_id: str, prompt: list[int], **params: Any) -> None:
        assert self.scheduler.add(submit(request_id, prompt, max_tokens=6, **params)) is None
        self.orders += self.scheduler.take_disk_orders()


PROMPT = list(range(1, 23))  # 5 full blocks and 2 tokens


def served(engine: Engine, request_id: str, prompt: list[int] = PROMPT) -> list[int]:
    engine.add(request_id, prompt)
    return engine.run().tokens[request_id, 0]


def test_a_prompt_served_by_a_dead_server_is_read_back_and_only_its_tail_computed(
    tmp_path: Path,
) -> None:
    first = Engine(tmp_path / "tier", num_blocks=32)
    assert served(first, "a") == expected(PROMPT, 1, 6)
    stats = first.scheduler.stats()
    # 5 prompt blocks and the sixth, filled by the output (the last token's KV is never made)
    assert stats.kv_disk_written_blocks == 6 and stats.kv_disk_unwritten_blocks == 0
    assert_no_state_left(first.scheduler, first.worker)

    second = Engine(tmp_path / "tier", num_blocks=32)  # a new root: nothing in RAM
    second.add("a", PROMPT)
    assert second.scheduler.schedule() is None, "it waits for its blocks"
    assert [type(order) for order in second.orders] == [LoadBlocks]
    assert second.move(LoadBlocks) == 1
    plan = second.step()
    assert plan is not None and [c.start_pos for c in plan.chunks] == [20]  # the tail only
    assert second.run().tokens["a", 0] == expected(PROMPT, 1, 6)
    stats = second.scheduler.stats()
    assert (stats.kv_disk_hit_blocks, stats.kv_disk_loads, stats.kv_disk_dropped_blocks) == (
        5,
        1,
        0,
    )
    assert stats.kv_disk_written_blocks == 0  # nothing new: every block was on disk already
    # Another tenant's cache scope (its salt in the chain) finds none of it, on disk or in RAM.
    salted = msgspec.structs.replace(submit("b", PROMPT, max_tokens=6), cache_salt="other")
    assert second.scheduler.add(salted) is None
    plan = second.step()
    assert plan is not None and [c.start_pos for c in plan.chunks] == [0]
    assert second.run().tokens["b", 0] == expected(PROMPT, 1, 6)
    assert second.scheduler.stats().kv_disk_loads == 1
    assert_no_state_left(second.scheduler, second.worker)


def test_others_run_while_a_request_waits_for_its_blocks(tmp_path: Path) -> None:
    served(Engine(tmp_path / "tier", num_blocks=32), "a")
    engine = Engine(tmp_path / "tier", num_blocks=32)
    engine.add("a", PROMPT)
    engine.add("b", [40, 41, 42])
    running = set()
    for _ in range(4):  # b runs, a waits: its load is not carried out yet
        plan = engine.step()
        assert plan is not None
        running |= {chunk.seq_id for chunk in plan.chunks}
    assert len(running) == 1 and engine.outputs.tokens["b", 0]
    engine.move(LoadBlocks)
    outputs = engine.run()
    assert outputs.tokens["a", 0] == expected(PROMPT, 1, 6)
    assert outputs.tokens["b", 0] == expected([40, 41, 42], 1, 6)


def test_blocks_evicted_from_ram_by_other_traffic_come_back_from_disk(tmp_path: Path) -> None:
    engine = Engine(tmp_path / "tier", num_blocks=16)
    assert served(engine, "a") == expected(PROMPT, 1, 6)
    other = list(range(100, 150))  # 13 blocks: a's last three go (its first two stay in RAM)
    assert served(engine, "other", other) == expected(other, 1, 6)
    chain = BlockHashChain(BLOCK_SIZE)
    in_ram = [engine.scheduler.kv.pool.lookup(chain.key(PROMPT, i)) is not None for i in range(5)]
    assert in_ram == [True, True, False, False, False]
    engine.add("a again", PROMPT)
    [load] = engine.orders
    assert isinstance(load, LoadBlocks) and len(load.blocks) == 3  # what RAM lacks, no more
    engine.move(LoadBlocks)
    plan = engine.step()
    assert plan is not None and [c.start_pos for c in plan.chunks] == [20]
    assert engine.run().tokens["a again", 0] == expected(PROMPT, 1, 6)
    assert engine.scheduler.stats().kv_disk_hit_blocks == 3
    assert_no_state_left(engine.scheduler, engine.worker)


def test_a_damaged_file_stops_the_read_there_and_the_rest_is_computed_exactly(
    tmp_path: Path,
) -> None:
    served(Engine(tmp_path / "tier", num_blocks=32), "a")
    engine = Engine(tmp_path / "tier", num_blocks=32)
    third = Path(engine.store.path(BlockHashChain(BLOCK_SIZE).key(PROMPT, 2)))
    third.write_bytes(third.read_bytes()[:-1])  # the third block's file loses its last byte
    engine.add("a", PROMPT)
    engine.move(LoadBlocks)
    plan = engine.step()
    assert plan is not None and [c.start_pos for c in plan.chunks] == [8]  # two blocks read back
    assert engine.run().tokens["a", 0] == expected(PROMPT, 1, 6)
    stats = engine.scheduler.stats()
    assert (stats.kv_disk_hit_blocks, stats.kv_disk_dropped_blocks) == (2, 1)
    assert stats.kv_disk_written_blocks == 1  # the dropped block, computed again, is rewritten
    assert_no_state_left(engine.scheduler, engine.worker)


def test_requests_sharing_a_prefix_wait_for_one_read_and_an_aborted_one_leaves_nothing(
    tmp_path: Path,
) -> None:
    served(Engine(tmp_path / "tier", num_blocks=32), "a")
    engine = Engine(tmp_path / "tier", num_blocks=32)
    engine.add("a", PROMPT)
    engine.add("b", [*PROMPT[:12], 77, 78])  # its first three blocks are a's
    engine.add("c", PROMPT)
    loads = [order for order in engine.orders if isinstance(order, LoadBlocks)]
    assert len(loads) == 1 and len(loads[0].blocks) == 5
    engine.scheduler.abort(["c"])
    engine.move(LoadBlocks)
    outputs = engine.run()
    assert outputs.tokens["a", 0] == expected(PROMPT, 1, 6)
    assert outputs.tokens["b", 0] == expected([*PROMPT[:12], 77, 78], 1, 6)
    assert ("c", 0) not in outputs.tokens
    assert_no_state_left(engine.scheduler, engine.worker)


def test_a_block_is_pinned_while_it_is_written_and_one_evicted_first_is_skipped(
    tmp_path: Path,
) -> None:
    engine = Engine(tmp_path / "tier", num_blocks=20)
    engine.add("a", PROMPT)
    while engine.scheduler.has_unfinished_requests:
        engine.step()  # the writes wait
    spills = [order for order in engine.orders if isinstance(order, SpillBlocks)]
    pinned = [block for order in spills for block, _ in order.blocks]
    assert len(pinned) == 4  # at most 4 (or an eighth of the pool) at once
    assert engine.scheduler.kv.num_free_blocks == 20 - 4, "not evictable while being written"
    # Other traffic takes every free block: a's two blocks not yet written are evicted.
    engine.add("b", list(range(200, 200 + 60)))
    while engine.scheduler.has_unfinished_requests:
        engine.step()
    engine.run()
    stats = engine.scheduler.stats()
    assert stats.kv_disk_skipped_blocks == 2
    assert stats.kv_disk_written_blocks == 4 + 15  # a's first four, and b's full blocks
    assert_no_state_left(engine.scheduler, engine.worker)
