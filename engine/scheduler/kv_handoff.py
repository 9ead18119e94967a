"""The scheduler's side of P/D disaggregation (DESIGN §9): holds on a prefill instance, pulls on a
decode instance. Plain Python, no I/O: orders for the kv_transfer actors queue in `orders`.

Prefill side (`KvHolds`). When a request asked to hand off has its first token, the scheduler
takes a reference on the request's full prompt blocks (so neither the request's end nor an
eviction frees them), tells every rank's kv_transfer actor to serve them (`HoldBlocks`), and
returns a `KvSource` for the handoff. The references go when every rank reports the puller's
acknowledgement, or at the hold's deadline, whichever comes first.

Decode side (`KvPulls`). A request that comes with a `KvSource` is not admitted at once: for
each of the source's blocks that this instance's prefix cache lacks, a free block is set aside
and the ranks are told to pull into it (`PullBlocks`). Once every rank reports its part arrived,
the blocks are indexed in the prefix cache under the prompt's block hashes and freed (cached),
and the request is admitted: admission finds them as a cached prefix and computes only the rest.
If any rank fails, or the deadline passes, the request is admitted anyway and computes its
prompt itself (a fallback, counted). The set-aside blocks are freed only once no rank can still
be writing into them (every rank reported, or the deadline plus a grace period passed).

`RankTally` is the one place where per-rank reports become one outcome.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv.block_manager import BlockManager
from engine.kv.prefix_cache import BlockHashChain
from engine.messages.kv_transfer import (
    BlocksPulled,
    BlocksReleased,
    DropHolds,
    HoldBlocks,
    KvEvent,
    KvOrder,
    KvSource,
    PullBlocks,
    TransferEndpoint,
    transfer_id,
)
from engine.messages.scheduling import SubmitRequest

log = logging.getLogger(__name__)

# After a pull's deadline, how long before its set-aside blocks are reused: a kv_transfer actor
# checks the deadline between copies, so none is still writing by then.
PULL_GRACE_S = 5.0


class Outcome(enum.Enum):
    DONE = "done"  # every rank reported success
    FAILED = "failed"  # some rank reported failure (the others may still be at work)


class RankTally:
    """Per-rank reports of one transfer, to one outcome: DONE only when every rank of the group
    reported success; FAILED from the first failure on. Reports of unknown ranks and repeats
    change nothing."""

    def __init__(self, num_ranks: int) -> None:
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        self.num_ranks = num_ranks
        self.succeeded: set[int] = set()
        self.failed: dict[int, str] = {}

    def record(self, rank: int, error: str | None = None) -> Outcome | None:
        if 0 <= rank < self.num_ranks and rank not in self.succeeded and rank not in self.failed:
            if error is None:
                self.succeeded.add(rank)
            else:
                self.failed[rank] = error
        return self.outcome

    @property
    def outcome(self) -> Outcome | None:
        if self.failed:
            return Outcome.FAILED
        if len(self.succeeded) == self.num_ranks:
            return Outcome.DONE
        return None

    @property
    def all_reported(self) -> bool:
        return len(self.succeeded) + len(self.failed) == self.num_ranks

    def first_error(self) -> str:
        return next(iter(self.failed.values()), "")


@dataclass
class _Hold:
    block_ids: list[int]
    deadline: float
    tally: RankTally


@dataclass
class KvTransferFigures:
    """Counts since start, for stats and /metrics."""

    handoffs: int = 0  # requests handed on (prefill side)
    holds_expired: int = 0  # holds freed by their deadline, not by an acknowledgement
    pulls: int = 0  # pulls whose KV arrived (decode side)
    blocks_pulled: int = 0
    bytes_pulled: int = 0
    pull_seconds: float = 0.0  # summed over arrived pulls (slowest rank of each)
    fallbacks: int = 0  # requests that computed their prompt because KV did not arrive
    blocks_from_cache: int = 0  # source blocks the prefix cache already had (not pulled)


class KvEndpoints:
    """Where each rank's kv_transfer actor serves, as they announce themselves."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self.by_rank: dict[int, TransferEndpoint] = {}

    def update(self, event: TransferEndpoint) -> None:
        self.by_rank[event.rank] = event

    @property
    def complete(self) -> bool:
        return len(self.by_rank) == self.num_ranks


class KvHolds:
    def __init__(
        self,
        kv: BlockManager,
        endpoints: KvEndpoints,
        hold_timeout: float,
        clock: Callable[[], float],
        orders: list[KvOrder],
        figures: KvTransferFigures,
    ) -> None:
        self._kv = kv
        self._endpoints = endpoints
        self._hold_timeout = hold_timeout
        self._clock = clock
        self._orders = orders
        self._figures = figures
        self._holds: dict[str, _Hold] = {}

    def hand_off(
        self, request_id: str, epoch: int, block_ids: list[int], num_prompt_tokens: int
    ) -> KvSource | None:
        """Hold the full prompt blocks among `block_ids` for a puller; None when this instance
        cannot serve them (a rank's kv_transfer actor has not announced itself yet)."""
        if not self._endpoints.complete:
            return None
        block_size = self._kv.block_size
        held = block_ids[: num_prompt_tokens // block_size]
        tid = transfer_id(request_id, epoch)
        self._release(tid)  # a replaced epoch's hold of the same attempt id, if any
        if held:  # a prompt shorter than a block has nothing worth moving: no hold
            for block_id in held:
                self._kv.pool.acquire(block_id)
            deadline = self._clock() + self._hold_timeout
            self._holds[tid] = _Hold(held, deadline, RankTally(self._endpoints.num_ranks))
            self._orders.append(HoldBlocks(tid, held, deadline))
        self._figures.handoffs += 1
        ranks = [self._endpoints.by_rank[rank] for rank in range(self._endpoints.num_ranks)]
        return KvSource(
            tid, [r.endpoint for r in ranks], held, len(held) * block_size, ranks[0].layout
        )

    def released(self, event: BlocksReleased) -> None:
        hold = self._holds.get(event.transfer_id)
        if hold is not None and hold.tally.record(event.rank) is Outcome.DONE:
            self._release(event.transfer_id)

    def expire(self) -> None:
        now = self._clock()
        expired = [tid for tid, hold in self._holds.items() if hold.deadline <= now]
        for tid in expired:
            self._release(tid)
        if expired:
            self._figures.holds_expired += len(expired)
            self._orders.append(DropHolds(expired))

    def resend(self) -> None:
        """A kv_transfer actor restarted: it knows no hold; tell every rank again (idempotent)."""
        for tid, hold in self._holds.items():
            self._orders.append(HoldBlocks(tid, hold.block_ids, hold.deadline))

    def forget_all(self) -> None:
        """The workers restarted: what the held blocks held is gone."""
        if self._holds:
            self._orders.append(DropHolds(list(self._holds)))
        for tid in list(self._holds):
            self._release(tid)

    @property
    def num_held(self) -> int:
        return len(self._holds)

    def _release(self, tid: str) -> None:
        hold = self._holds.pop(tid, None)
        if hold is not None:
            self._kv.pool.release(hold.block_ids[::-1])


@dataclass
class _Pull:
    submit: SubmitRequest
    dst_block_ids: list[int]
    block_hashes: list[bytes]  # for each pulled block, its prefix-cache key
    deadline: float
    tally: RankTally
    admitted: bool = False  # the request went on (KV arrived, or it fell back)
    void: bool = False  # the cache the blocks were pulled into is gone: never index them
    num_bytes: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


class KvPulls:
    def __init__(
        self,
        kv: BlockManager,
        endpoints: KvEndpoints,
        timeout: float,
        clock: Callable[[], float],
        orders: list[KvOrder],
        figures: KvTransferFigures,
    ) -> None:
        self._kv = kv
        self._endpoints = endpoints
        self._num_ranks = endpoints.num_ranks
        self._timeout = timeout
        self._clock = clock
        self._orders = orders
        self._figures = figures
        self._pulls: dict[str, _Pull] = {}  # by transfer id
        self._by_request: dict[str, str] = {}  # request id -> its pending pull's transfer id

    def begin(self, submit: SubmitRequest) -> bool:
        """Start pulling the KV `submit.kv_source` names; False: admit the request now (nothing
        held for it, no room to pull into, or a source this instance cannot read)."""
        source = submit.kv_source
        assert source is not None
        if not source.block_ids:
            return False  # nothing was held for us
        problem = self._unreadable(submit, source)
        if problem is None and source.transfer_id in self._pulls:
            # The same transfer submitted again while its first pull is under way: the ranks'
            # reports could not be told apart, and its blocks are still being written.
            problem = f"transfer {source.transfer_id} is already being pulled"
        if problem is not None:
            log.warning("request %s computes its prompt: %s", submit.request_id, problem)
            self._figures.fallbacks += 1
            return False
        block_size = self._kv.block_size
        chain = BlockHashChain(block_size)
        pool = self._kv.pool
        wanted: list[tuple[int, bytes]] = []  # (source block, its key) the cache lacks
        for index, block_id in enumerate(source.block_ids):
            key = chain.key(submit.prompt_token_ids, index)
            if pool.lookup(key) is None:
                wanted.append((block_id, key))
        self._figures.blocks_from_cache += len(source.block_ids) - len(wanted)
        # With every block cached here, the pull moves nothing but still acknowledges, which
        # ends the source's hold at once instead of at its timeout.
        if len(wanted) > pool.num_free_blocks:
            self._figures.fallbacks += 1
            return False
        dst = pool.allocate(len(wanted))
        deadline = self._clock() + self._timeout
        tid = source.transfer_id
        pull = _Pull(submit, dst, [key for _, key in wanted], deadline, RankTally(self._num_ranks))
        self._pulls[tid] = pull
        self._by_request[submit.request_id] = tid
        self._orders.append(PullBlocks(tid, source, [b for b, _ in wanted], dst, deadline))
        return True

    def _unreadable(self, submit: SubmitRequest, source: KvSource) -> str | None:
        """Why this instance cannot take the source's blocks as they are, if it cannot."""
        if not self._kv.enable_prefix_caching:
            return "pulled KV needs the prefix cache, which is off here"
        if len(source.endpoints) != self._num_ranks:
            return (f"the source has {len(source.endpoints)} tensor-parallel ranks, this "
                    f"instance {self._num_ranks}")  # fmt: skip
        if source.num_tokens > len(submit.prompt_token_ids):
            return f"the source holds {source.num_tokens} tokens of a shorter prompt"
        ours = self._endpoints.by_rank.get(0)
        if ours is None:
            return "this instance's kv_transfer actors have not announced themselves yet"
        return ours.layout.mismatch(source.layout)

    def pulled(self, event: BlocksPulled) -> list[SubmitRequest]:
        """A rank's report; the requests that may now be admitted."""
        pull = self._pulls.get(event.transfer_id)
        if pull is None:
            return []
        outcome = pull.tally.record(event.rank, event.error)
        if event.error is None:
            pull.num_bytes += event.num_bytes
            pull.seconds = max(pull.seconds, event.seconds)
        admit = self._settle(event.transfer_id, pull, outcome)
        return [admit] if admit is not None else []

    def rank_restarted(self, rank: int) -> list[SubmitRequest]:
        """A rank's kv_transfer actor restarted: its part of every pull is lost (and it writes
        no more)."""
        ready = []
        for tid, pull in list(self._pulls.items()):
            outcome = pull.tally.record(rank, f"kv_transfer rank {rank} restarted")
            admit = self._settle(tid, pull, outcome)
            if admit is not None:
                ready.append(admit)
        return ready

    def expire(self) -> list[SubmitRequest]:
        """Pulls past their deadline fall back; their blocks are reused after the grace."""
        now = self._clock()
        ready = []
        for tid, pull in list(self._pulls.items()):
            if not pull.admitted and now >= pull.deadline:
                pull.errors.append("the pull timed out")
                log.warning("request %s computes its prompt: the pull of %s timed out",
                            pull.submit.request_id, tid)  # fmt: skip
                admit = self._fall_back(pull)
                if admit is not None:
                    ready.append(admit)
            if pull.admitted and now >= pull.deadline + PULL_GRACE_S:
                self._drop(tid)
        return ready

    def cancel(self, request_id: str) -> bool:
        """The request was aborted or replaced while its KV was on the way; True if it was
        pending here (it will not be admitted)."""
        tid = self._by_request.pop(request_id, None)
        pull = self._pulls.get(tid or "")
        if pull is None:
            return False
        was_pending = not pull.admitted
        pull.admitted = True  # never admit it now; the blocks wait for the ranks
        if pull.tally.all_reported:
            self._drop(tid or "")
        return was_pending

    def void_all(self) -> None:
        """The workers restarted: their cache is gone, so no block pulled so far may be indexed;
        the requests themselves are being resubmitted."""
        for pull in self._pulls.values():
            pull.void = True
            pull.admitted = True
        self._by_request.clear()

    @property
    def num_pending(self) -> int:
        return sum(1 for pull in self._pulls.values() if not pull.admitted)

    def _settle(self, tid: str, pull: _Pull, outcome: Outcome | None) -> SubmitRequest | None:
        admit = None
        if outcome is Outcome.DONE and not pull.admitted and not pull.void:
            self._index(pull)
            admit = self._admit(pull)
            self._figures.pulls += 1
            self._figures.blocks_pulled += len(pull.dst_block_ids)
            self._figures.bytes_pulled += pull.num_bytes
            self._figures.pull_seconds += pull.seconds
            del self._pulls[tid]  # the blocks are the prefix cache's now
            return admit
        if outcome is Outcome.FAILED:
            pull.errors.append(pull.tally.first_error())
            if not pull.admitted:
                log.warning("request %s computes its prompt: the pull of %s failed: %s",
                            pull.submit.request_id, tid, pull.errors[-1])  # fmt: skip
            admit = self._fall_back(pull)
        if pull.tally.all_reported:
            self._drop(tid)
        return admit

    def _fall_back(self, pull: _Pull) -> SubmitRequest | None:
        if pull.admitted:
            return None
        self._figures.fallbacks += 1
        return self._admit(pull)

    def _admit(self, pull: _Pull) -> SubmitRequest:
        pull.admitted = True
        self._by_request.pop(pull.submit.request_id, None)
        return pull.submit

    def _index(self, pull: _Pull) -> None:
        """Arrived blocks become cached prefix blocks (then free, so admission takes them)."""
        pool = self._kv.pool
        for block_id, key in zip(pull.dst_block_ids, pull.block_hashes, strict=True):
            pool.register(block_id, key)
        pool.release(pull.dst_block_ids[::-1])

    def _drop(self, tid: str) -> None:
        """Free a pull's set-aside blocks (no rank writes into them any more)."""
        pull = self._pulls.pop(tid, None)
        if pull is None:
            return
        if self._by_request.get(pull.submit.request_id) == tid:
            del self._by_request[pull.submit.request_id]
        self._kv.pool.release(pull.dst_block_ids[::-1])


class KvTransfer:
    """Holds and pulls of one scheduler, and the orders for its kv_transfer actors."""

    def __init__(
        self, kv: BlockManager, num_ranks: int, hold_timeout: float, clock: Callable[[], float]
    ) -> None:
        self.orders: list[KvOrder] = []
        self.figures = KvTransferFigures()
        self.endpoints = KvEndpoints(num_ranks)
        self.holds = KvHolds(kv, self.endpoints, hold_timeout, clock, self.orders, self.figures)
        self.pulls = KvPulls(kv, self.endpoints, hold_timeout, clock, self.orders, self.figures)

    def on_event(self, event: KvEvent) -> list[SubmitRequest]:
        """A kv_transfer actor's report; the requests whose KV is now settled (to admit)."""
        if isinstance(event, BlocksReleased):
            self.holds.released(event)
            return []
        if isinstance(event, BlocksPulled):
            return self.pulls.pulled(event)
        restarted = event.rank in self.endpoints.by_rank  # announced before: it restarted
        self.endpoints.update(event)
        if not restarted:
            return []
        self.holds.resend()
        return self.pulls.rank_restarted(event.rank)

    def tick(self) -> list[SubmitRequest]:
        """Expire holds and pulls past their deadlines (call about once a second)."""
        self.holds.expire()
        return self.pulls.expire()

    def on_workers_restarted(self) -> None:
        self.holds.forget_all()
        self.pulls.void_all()

    def stats(self) -> dict[str, int | float]:
        """SchedulerFigures' kv_* fields."""
        figures = self.figures
        return {
            "kv_holds": self.holds.num_held,
            "kv_pulls_in_flight": self.pulls.num_pending,
            "kv_handoffs": figures.handoffs,
            "kv_holds_expired": figures.holds_expired,
            "kv_pulls": figures.pulls,
            "kv_blocks_pulled": figures.blocks_pulled,
            "kv_bytes_pulled": figures.bytes_pulled,
            "kv_pull_seconds": figures.pull_seconds,
            "kv_fallbacks": figures.fallbacks,
            "kv_blocks_from_cache": figures.blocks_from_cache,
        }

    def take_orders(self) -> list[KvOrder]:
        orders = list(self.orders)
        self.orders.clear()  # the holds and pulls keep appending to this same list
        return orders
