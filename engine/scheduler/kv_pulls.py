"""The decode side of P/D in the scheduler (see engine/scheduler/kv_handoff.py): a request that
comes with a KvSource waits while the ranks pull the blocks its prefix cache lacks, then enters
the prefix cache's view and is admitted; any failure makes it compute its prompt instead.

Pulled blocks are filed in the shared prefix cache, where every later request with the same
prefix reuses them, so they must be what they claim, and the source's word is not enough:
- the source is a verified one: across instances, a KvSource reaches a scheduler only once the
  root checked its signature (the prefill instance's, with the deployment secret), its expiry
  and its endpoints against kv_transfer.peers (engine/inflight/kv_params.py); in one launch it
  comes from a replica of the same root. The bytes come over a connection on which the source
  proved the same secret (engine/kv/transfer/handshake.py);
- the blocks are bound to this request's tokens: the signed `prompt_key` must be this prompt's
  own prefix-cache key of the last block, or nothing is pulled (a client cannot pair one
  prompt's KV with another prompt)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv.cache.block_manager import BlockManager
from engine.kv.cache.prefix_cache import BlockHashChain
from engine.messages.kv_transfer import BlocksPulled, KvOrder, KvSource, PullBlocks
from engine.messages.scheduling import SubmitRequest
from engine.scheduler.kv_tally import KvEndpoints, KvTransferFigures, Outcome, RankTally
from engine.scheduler.requests import submitted_kv_salt

log = logging.getLogger(__name__)

# After a pull's deadline, how long before its set-aside blocks are reused: a kv_transfer actor
# checks the deadline between copies, so none is still writing by then.
PULL_GRACE_S = 5.0


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
        keys = BlockHashChain(self._kv.block_size, submitted_kv_salt(submit)).first(
            submit.prompt_token_ids, len(source.block_ids) if problem is None else 0
        )
        if problem is None and keys[-1].hex() != source.prompt_key:
            # Filed under this prompt's keys, another prompt's blocks would serve a wrong
            # prefix to every request that shares it.
            problem = "the source's blocks hold the KV of another prompt"
        if problem is not None:
            log.warning("request %s computes its prompt: %s", submit.request_id, problem)
            self._figures.fallbacks += 1
            return False
        pool = self._kv.pool
        wanted: list[tuple[int, bytes]] = []  # (source block, its key) the cache lacks
        for block_id, key in zip(source.block_ids, keys, strict=True):
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
            return (
                f"the source has {len(source.endpoints)} tensor-parallel ranks, this "
                f"instance {self._num_ranks}"
            )
        if source.num_tokens > len(submit.prompt_token_ids):
            return f"the source holds {source.num_tokens} tokens of a shorter prompt"
        ours = self._endpoints.by_rank.get(0)
        if ours is None:
            return "this instance's kv_transfer actors have not announced themselves yet"
        mismatch = ours.layout.mismatch(source.layout)
        if mismatch is None and source.num_tokens != len(source.block_ids) * self._kv.block_size:
            return f"the source names {len(source.block_ids)} blocks for {source.num_tokens} tokens"
        return mismatch

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
                log.warning(
                    "request %s computes its prompt: the pull of %s timed out",
                    pull.submit.request_id,
                    tid,
                )
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
                log.warning(
                    "request %s computes its prompt: the pull of %s failed: %s",
                    pull.submit.request_id,
                    tid,
                    pull.errors[-1],
                )
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
