"""The scheduler's side of P/D disaggregation: holds on a prefill instance, pulls on a decode
instance. Plain Python, no I/O: orders for the kv_transfer actors queue in `orders`.

Prefill side (`KvHolds`). When a request asked to hand off has its first token, the scheduler
takes a reference on the request's full prompt blocks (so neither the request's end nor an
eviction frees them), tells every rank's kv_transfer actor to serve them (`HoldBlocks`) under a
fresh random transfer id, and returns a `KvSource` for the handoff, bound to the prompt's tokens
by its `prompt_key` (the root signs it before a client sees it: engine/inflight/kv_params.py).
The references go when every rank reports the puller's acknowledgement, or at the hold's
deadline, whichever comes first.

Decode side (`KvPulls`). A request that comes with a `KvSource` is not admitted at once: for
each of the source's blocks that this instance's prefix cache lacks, a free block is set aside
and the ranks are told to pull into it (`PullBlocks`). Once every rank reports its part arrived,
the blocks are indexed in the prefix cache under the prompt's block hashes and freed (cached),
and the request is admitted: admission finds them as a cached prefix and computes only the rest.
If any rank fails, or the deadline passes, the request is admitted anyway and computes its
prompt itself (a fallback, counted). The set-aside blocks are freed only once no rank can still
be writing into them (every rank reported, or the deadline plus a grace period passed).

`RankTally` (kv_tally.py) is the one place where per-rank reports become one outcome; the
decode side is kv_pulls.py.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.kv.cache.block_manager import BlockManager
from engine.kv.cache.prefix_cache import BlockHashChain
from engine.messages.kv_transfer import (
    BlocksPulled,
    BlocksReleased,
    ConnectionsRefused,
    DropHolds,
    HoldBlocks,
    KvEvent,
    KvOrder,
    KvSource,
)
from engine.messages.scheduling import SubmitRequest
from engine.scheduler.kv_pulls import KvPulls
from engine.scheduler.kv_tally import KvEndpoints, KvTransferFigures, Outcome, RankTally
from engine.scheduler.requests import SequenceState

# Held blocks may take at most this share of the KV pool. A hold pins its blocks until a puller
# acknowledges it or its deadline passes, and any client of a prefill instance can ask for one
# (do_remote_decode): unbounded, unpulled holds would leave no block to admit requests with.
MAX_HELD_SHARE = 0.5


def new_transfer_id() -> str:
    """128 random bits: a transfer id nobody can guess, whatever the request's id is."""
    return secrets.token_hex(16)


@dataclass
class _Hold:
    block_ids: list[int]
    deadline: float
    tally: RankTally
    attempt: tuple[str, int]  # (request id, epoch)


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
        self._by_attempt: dict[tuple[str, int], str] = {}  # (request id, epoch) -> transfer id
        self._blocks_held = 0
        self._max_blocks_held = int(kv.num_blocks * MAX_HELD_SHARE)
        self.new_transfer_id = new_transfer_id  # tests may make ids predictable

    def hand_off(
        self,
        request_id: str,
        epoch: int,
        block_ids: list[int],
        prompt_token_ids: Sequence[int],
        salt: bytes = b"",
    ) -> KvSource | None:
        """Hold the full prompt blocks among `block_ids` for a puller; None when this instance
        cannot serve them (a rank's kv_transfer actor has not announced itself yet). With the
        held blocks at their cap (MAX_HELD_SHARE), none are held: the puller computes the
        prompt itself, as for a prompt shorter than a block. `salt`: what the request's KV is
        keyed by beside its tokens (the puller files the blocks under the same keys)."""
        if not self._endpoints.complete:
            return None
        block_size = self._kv.block_size
        held = block_ids[: len(prompt_token_ids) // block_size]
        attempt = (request_id, epoch)
        self._release(self._by_attempt.get(attempt, ""))  # the same attempt handed off before
        if held and self._blocks_held + len(held) > self._max_blocks_held:
            held = []
            self._figures.holds_refused += 1
        tid = self.new_transfer_id()
        prompt_key = ""
        if held:  # a prompt shorter than a block has nothing worth moving: no hold
            for block_id in held:
                self._kv.pool.acquire(block_id)
            deadline = self._clock() + self._hold_timeout
            tally = RankTally(self._endpoints.num_ranks)
            self._holds[tid] = _Hold(held, deadline, tally, attempt)
            self._blocks_held += len(held)
            self._by_attempt[attempt] = tid
            self._orders.append(HoldBlocks(tid, held, deadline))
            chain = BlockHashChain(block_size, salt)
            prompt_key = chain.key(prompt_token_ids, len(held) - 1).hex()
        self._figures.handoffs += 1
        ranks = [self._endpoints.by_rank[rank] for rank in range(self._endpoints.num_ranks)]
        return KvSource(
            tid,
            [r.endpoint for r in ranks],
            held,
            len(held) * block_size,
            ranks[0].layout,
            prompt_key=prompt_key,
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
            del self._by_attempt[hold.attempt]
            self._blocks_held -= len(hold.block_ids)
            self._kv.pool.release(hold.block_ids[::-1])


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
        if isinstance(event, ConnectionsRefused):
            self.figures.refused_connections += event.count
            return []
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
            "kv_holds_refused": figures.holds_refused,
            "kv_holds_expired": figures.holds_expired,
            "kv_pulls": figures.pulls,
            "kv_blocks_pulled": figures.blocks_pulled,
            "kv_bytes_pulled": figures.bytes_pulled,
            "kv_pull_seconds": figures.pull_seconds,
            "kv_fallbacks": figures.fallbacks,
            "kv_blocks_from_cache": figures.blocks_from_cache,
            "kv_refused_connections": figures.refused_connections,
        }

    def hand_off(self, seq: SequenceState, reason: str | None) -> KvSource | None:
        """Hold a prompt's KV for a decode instance (P/D) once its first token is out; the
        source to give the client (None: nothing goes on, or no hold could be made)."""
        if seq.num_output_tokens != 1:
            return None
        if seq.request.kv_handoff == "continue" and reason is not None:
            return None  # it ends here: nothing goes on
        request = seq.request
        return self.holds.hand_off(
            request.request_id,
            request.epoch,
            seq.block_table.block_ids,
            request.prompt_token_ids,
            request.kv_salt,
        )

    def take_orders(self) -> list[KvOrder]:
        orders = list(self.orders)
        self.orders.clear()  # the holds and pulls keep appending to this same list
        return orders
