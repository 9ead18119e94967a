"""The scheduler's side of the prefix cache's disk tier (engine/kv/disk/): which blocks go to
disk, which come back, and the requests that wait for them.

Spills. Every full block the prefix cache indexes is written once, soon after its step came back
(not when it is evicted: a root that dies takes the RAM cache with it, and what was never evicted
must still be on disk). A block being written is pinned (engine/kv/cache/block_pool.py), so
nothing can evict and rewrite it meanwhile, while it keeps its place in the eviction order; at
most `max_spilling` are pinned at once, and blocks queued beyond that wait unpinned: one evicted
meanwhile is skipped (and counted), never written from reused memory.

Loads. A request's prompt is looked up when it arrives: the blocks RAM lacks and disk has are
read into blocks set aside for them (up to the first block neither has), while the request waits
outside the queue and every other request runs. Once read, they are indexed like any computed
block; the request holds them, and what RAM had of its prompt, until its first chunk is planned
(then its own references keep them), so that the admissions before it cannot evict them. A block
already being read for another request is waited for, not read twice. A load that stops short (a
file gone or dropped) leaves the request to compute the rest, as a RAM miss would.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv.cache.block_manager import BlockManager
from engine.kv.cache.prefix_cache import BlockHashChain
from engine.kv.disk.orders import (
    BlocksLoaded,
    BlocksSpilled,
    DiskEvent,
    DiskOrder,
    LoadBlocks,
    SpillBlocks,
)
from engine.messages.scheduling import SubmitRequest
from engine.scheduler.requests import submitted_kv_salt


@dataclass
class _Load:
    blocks: list[tuple[int, bytes]]
    waiters: list[str] = field(default_factory=list)  # request ids


@dataclass
class _Waiter:
    submit: SubmitRequest
    loads: set[int]  # load ids still under way
    held: list[int] = field(default_factory=list)  # blocks read for it, one reference each


@dataclass
class DiskFigures:
    """SchedulerFigures' kv_disk_* fields, counted since start."""

    hit_blocks: int = 0  # blocks read back and indexed
    read_bytes: int = 0
    written_blocks: int = 0
    written_bytes: int = 0
    evicted_blocks: int = 0  # files the size bound removed
    dropped_blocks: int = 0  # files that failed their checks
    skipped_blocks: int = 0  # never written: evicted from RAM before the writer got to them
    loads: int = 0
    full: bool = False


class DiskTier:
    def __init__(
        self,
        kv: BlockManager,
        on_disk: Callable[[bytes], bool],
        max_spilling: int,
        reserve_blocks: int,
    ) -> None:
        """`on_disk(key)`: whether the tier has a file for the block (engine/kv/disk/store.py's
        `contains`); `reserve_blocks`: the free blocks a load leaves to the running requests."""
        self._kv = kv
        self._on_disk = on_disk
        self._max_spilling = max_spilling
        self._reserve = reserve_blocks
        self._pending: deque[tuple[int, bytes]] = deque()  # indexed, to write
        self._spilling: dict[int, bytes] = {}  # block id -> key, pinned while being written
        self._loads: dict[int, _Load] = {}
        self._loading: dict[bytes, int] = {}  # key -> the load reading it
        self._waiters: dict[str, _Waiter] = {}
        self._orders: list[DiskOrder] = []
        self._next_load = 0
        self.figures = DiskFigures()

    # ---- spills --------------------------------------------------------------------------------

    def indexed(self, blocks: list[tuple[int, bytes]]) -> None:
        """Blocks the prefix cache just indexed (block id, key): to be written."""
        self._pending.extend(blocks)
        while len(self._pending) > self._kv.num_blocks:  # far behind: the oldest are lost
            self._pending.popleft()
            self.figures.skipped_blocks += 1

    def _start_spills(self) -> None:
        pool = self._kv.pool
        batch = []
        while self._pending and len(self._spilling) < self._max_spilling:
            block_id, key = self._pending.popleft()
            if pool.block_hashes[block_id] != key:  # evicted before its turn
                self.figures.skipped_blocks += 1
                continue
            if block_id in self._spilling:
                continue
            pool.pin(block_id)
            self._spilling[block_id] = key
            batch.append((block_id, key))
        if batch:
            self._orders.append(SpillBlocks(batch))

    def _spilled(self, event: BlocksSpilled) -> None:
        for block_id in event.block_ids:
            if self._spilling.pop(block_id, None) is not None:
                self._kv.pool.unpin(block_id)
        figures = self.figures
        figures.written_blocks += event.written_blocks
        figures.written_bytes += event.written_bytes
        figures.evicted_blocks += event.evicted_blocks
        figures.full = event.full

    # ---- loads ---------------------------------------------------------------------------------

    def begin_load(self, submit: SubmitRequest) -> bool:
        """Start reading what the disk has of `submit`'s prompt and RAM lacks; True: the request
        waits for it (`on_event` gives it back), False: take it in now."""
        if computes_whole_prompt(submit):
            return False
        tokens = _known_tokens(submit)
        chain = BlockHashChain(self._kv.block_size, submitted_kv_salt(submit))
        pool = self._kv.pool
        room = self._kv.num_free_blocks - self._reserve
        in_ram: list[int] = []
        waited: set[int] = set()
        wanted: list[bytes] = []
        for index in range((len(tokens) - 1) // self._kv.block_size):
            key = chain.key(tokens, index)
            block_id = pool.lookup(key)
            if block_id is not None:
                in_ram.append(block_id)
                room -= pool.counted_free(block_id)  # held below: not free for the load
            elif key in self._loading:  # being read for another request: wait for it too
                waited.add(self._loading[key])
            elif len(wanted) < room and self._on_disk(key):
                wanted.append(key)
            else:
                break
        wanted = wanted[: max(0, room)]  # what RAM had after them took room too
        if not wanted and not waited:
            return False
        # What RAM has of it is held first: the load must not evict it (a block read is of no
        # use once one before it is gone).
        for block_id in in_ram:
            pool.acquire(block_id)
        if wanted:
            waited.add(self._order_load(wanted))
        self._waiters[submit.request_id] = _Waiter(submit, waited, in_ram)
        for load_id in waited:
            self._loads[load_id].waiters.append(submit.request_id)
        return True

    def _order_load(self, keys: list[bytes]) -> int:
        load_id = self._next_load
        self._next_load += 1
        blocks = list(zip(self._kv.pool.allocate(len(keys)), keys, strict=True))
        self._loads[load_id] = _Load(blocks)
        for key in keys:
            self._loading[key] = load_id
        self._orders.append(LoadBlocks(load_id, blocks))
        return load_id

    def _loaded(self, event: BlocksLoaded) -> list[tuple[SubmitRequest, list[int]]]:
        """Index what arrived, hand it to the waiters; the requests that wait no more, each
        with the blocks it holds."""
        load = self._loads.pop(event.load_id)
        pool = self._kv.pool
        arrived = load.blocks[: event.num_loaded]
        for block_id, key in arrived:
            pool.register(block_id, key)  # False: another block has it (computed meanwhile)
        for _, key in load.blocks:
            self._loading.pop(key, None)
        ready = []
        for request_id in load.waiters:
            waiter = self._waiters.get(request_id)
            if waiter is None:
                continue
            for block_id, _ in arrived:
                pool.acquire(block_id)
                waiter.held.append(block_id)
            waiter.loads.discard(event.load_id)
            if not waiter.loads:
                del self._waiters[request_id]
                ready.append((waiter.submit, waiter.held))
        pool.release([block_id for block_id, _ in reversed(load.blocks)])
        figures = self.figures
        figures.loads += 1
        figures.hit_blocks += len(arrived)
        figures.read_bytes += event.read_bytes
        figures.dropped_blocks += event.dropped_blocks
        return ready

    def cancel(self, request_id: str) -> None:
        """The request went (aborted, replaced): it waits no more; what is read for it stays."""
        waiter = self._waiters.pop(request_id, None)
        if waiter is not None:
            self._kv.pool.release(waiter.held[::-1])

    # ---- the mover's side ----------------------------------------------------------------------

    def take_orders(self) -> list[DiskOrder]:
        self._start_spills()
        orders, self._orders = self._orders, []
        return orders

    def on_event(self, event: DiskEvent) -> list[tuple[SubmitRequest, list[int]]]:
        if isinstance(event, BlocksSpilled):
            self._spilled(event)
            return []
        return self._loaded(event)

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    @property
    def num_unwritten(self) -> int:
        """Blocks queued or being written."""
        return len(self._pending) + len(self._spilling)

    def stats(self) -> dict[str, int]:
        """SchedulerFigures' kv_disk_* fields."""
        figures = self.figures
        return {
            "kv_disk_hit_blocks": figures.hit_blocks,
            "kv_disk_read_bytes": figures.read_bytes,
            "kv_disk_written_blocks": figures.written_blocks,
            "kv_disk_written_bytes": figures.written_bytes,
            "kv_disk_evicted_blocks": figures.evicted_blocks,
            "kv_disk_dropped_blocks": figures.dropped_blocks,
            "kv_disk_skipped_blocks": figures.skipped_blocks,
            "kv_disk_loads": figures.loads,
            "kv_disk_loads_waiting": self.num_waiting,
            "kv_disk_unwritten_blocks": self.num_unwritten,
            "kv_disk_full": int(figures.full),
        }


def _known_tokens(submit: SubmitRequest) -> list[int]:
    """The tokens whose KV the request's first sample needs: its prompt, and what a resumed
    one had delivered."""
    if submit.resume and len(submit.resume) == 1:
        return [*submit.prompt_token_ids, *submit.resume[0].delivered_token_ids]
    return submit.prompt_token_ids


def computes_whole_prompt(submit: SubmitRequest) -> bool:
    """Prompt logprobs or a MEAN embedding: no prompt token may come from any cache."""
    pooling = submit.params.pooling
    scored = submit.params.prompt_logprobs is not None and not submit.resume
    return scored or (pooling is not None and pooling.pooling_type == "MEAN")


def disk_tier_for(kv: BlockManager, on_disk: Callable[[bytes], bool]) -> DiskTier:
    """The tier's side for a pool: an eighth of it may be pinned being written, and a load leaves
    a sixteenth free for the running requests."""
    return DiskTier(kv, on_disk, max(4, kv.num_blocks // 8), max(1, kv.num_blocks // 16))
