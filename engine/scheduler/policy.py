"""Who runs in the next step and how many tokens each: continuous batching under two budgets.

Running sequences go first, decodes before unfinished prefills, so a long prompt never stalls
the token stream of requests already generating. Waiting sequences are admitted after them, most
urgent first (vLLM's `priority`: lower runs first), then in arrival order, while there is token
budget, a sequence slot and KV room; a prompt larger than the budget is prefilled in chunks over
several steps. When a running sequence needs a block and none is free, a running sequence is
preempted by recompute: the least urgent, then of the tenant holding the most KV per unit of
weight, then the most recently admitted. Its blocks go back to the pool and it waits again, to
be prefilled anew (prompt + tokens so far) once there is room. A waiting sequence more urgent
than running ones preempts the least urgent of them when it could not be admitted otherwise.

With several tenants (engine/scheduler/tenancy.py) each step's tokens are first granted by fair
share (fair_share.py), and each sequence runs within its tenant's grant; what a tenant cannot
use (no KV room, no slot) goes to anyone in a second pass over the waiting. A tenant over its
share of the cache that finds no room waits alone; anyone else keeps arrival order.

Samples of one request share the prompt's KV: while one sample prefills the prompt, its
siblings wait; then each is admitted holding references to the prompt's full, computed blocks
and computes only the rest (the partial last block, at least one token). This works with or
without the prefix cache and needs no copy-on-write, since shared blocks are never written.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

from engine.kv.cache.block_manager import BlockManager
from engine.scheduler.fair_share import FairShare
from engine.scheduler.requests import SeqStatus, SequenceState
from engine.scheduler.tenancy import (
    StepRoom,
    TenantTally,
    blocks_per_weight,
    over_share,
    step_grants,
)


class ScheduledChunk(NamedTuple):
    seq: SequenceState
    start: int  # first token position to compute
    num_tokens: int


def queue_order(seq: SequenceState) -> tuple[int, int, int]:
    """Most urgent first, then in arrival order (a request's key grows with arrivals)."""
    return seq.request.priority, seq.request.key, seq.index


class BatchPlanner:
    def __init__(
        self,
        kv: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_plan_bytes: int,
        max_loras: int = 0,
    ) -> None:
        self.kv = kv
        self.max_loras = max_loras  # distinct LoRA adapters among the running; 0: no limit
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # A plan is one frame on a ring: what it carries (announcements above all) must fit.
        self.max_plan_bytes = max_plan_bytes
        self.waiting: list[SequenceState] = []  # in queue_order
        self.running: list[SequenceState] = []  # in admission order
        self.num_preemptions = 0
        self.fair_share = FairShare()
        self.tally = TenantTally()
        self.num_plans = 0

    # ---- queue membership ----------------------------------------------------------------------

    def enqueue(self, seq: SequenceState) -> None:
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=queue_order)

    def remove(self, seq: SequenceState) -> None:
        """Take `seq` out of its queue for good; a running one gives its blocks back at once."""
        if seq.status is SeqStatus.RUNNING:
            self.kv.free(seq.block_table)
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def preempt(self, seq: SequenceState, count: bool = True) -> None:
        """Drop `seq`'s KV and queue it again (ahead of everyone of its priority who came
        after it), to be recomputed."""
        self.kv.free(seq.block_table)
        self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.needs_announce = True
        self.enqueue(seq)
        if count:
            self.num_preemptions += 1
            seq.request.num_preemptions += 1
            self.tally.preemptions[seq.request.tenant] += 1

    # ---- planning ------------------------------------------------------------------------------

    def plan(self) -> list[ScheduledChunk]:
        self.num_plans += 1
        budget = self.max_num_batched_tokens
        self._preempt_for_priority(budget)
        free_slots = self.max_num_seqs - len(self.running)
        grants = step_grants(self.fair_share, self.running, self.waiting, budget, free_slots)
        step = StepRoom(budget, self.max_plan_bytes, grants)
        chunks: list[ScheduledChunk] = []
        preempted = self._plan_running(chunks, step)
        if not (preempted and chunks):  # memory is short: admit no one until the running move
            self._admit_waiting(chunks, step)
            if step.tokens and step.lift_grants():
                self._admit_waiting(chunks, step)
        for chunk in chunks:
            chunk.seq.last_planned = self.num_plans
            self.tally.count(chunk.seq, chunk.start, chunk.num_tokens)
        return chunks

    def _plan_running(self, chunks: list[ScheduledChunk], step: StepRoom) -> bool:
        """Chunks of the running sequences, within their tenants' grants; whether any was
        preempted. Decodes take turns: those that waited longest go first."""
        scheduled: set[int] = set()
        preempted = False
        decoding = [seq for seq in self.running if seq.num_uncomputed_tokens == 1]
        decoding.sort(key=lambda seq: seq.last_planned)
        prefilling = [seq for seq in self.running if seq.num_uncomputed_tokens > 1]
        for seq in decoding + prefilling:
            if step.tokens == 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted for an earlier one this step
                continue
            num_tokens = min(seq.num_uncomputed_tokens, step.allowed(seq))
            if num_tokens == 0:
                continue  # its tenant's grant is spent
            size = seq.plan_bytes(num_tokens, seq.num_computed_tokens + num_tokens)
            if size > step.plan_bytes and chunks:
                break  # the frame is full: the rest run next step
            reserved, preempted_some = self._reserve(seq, num_tokens, scheduled)
            preempted = preempted or preempted_some
            if reserved:
                chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, num_tokens))
                scheduled.add(seq.seq_id)
                step.take(seq, num_tokens, size)
        return preempted

    def _admit_waiting(self, chunks: list[ScheduledChunk], step: StepRoom) -> None:
        blocked: set[str] = set()  # tenants over their share of the cache that found no room
        for seq in list(self.waiting):
            if step.tokens == 0 or len(self.running) >= self.max_num_seqs:
                break
            allowed = step.allowed(seq)
            if allowed == 0 or seq.request.tenant in blocked:
                continue  # its tenant's grant is spent, or it waits for room
            if self._waits_for_sibling(seq) or not self._adapter_fits(seq):
                continue  # a sequence of another adapter may go first
            # Cache hits are not known yet: count the whole table the sequence could need.
            size = seq.plan_bytes(min(seq.num_tokens, allowed), seq.num_tokens)
            if size > step.plan_bytes and chunks:
                break  # no room left in this plan's frame: admitted next step, in order
            chunk = self._admit(seq, allowed)
            if chunk is None:
                tenant = seq.request.tenant
                if not over_share(tenant, self.running, self.waiting, self.kv.num_blocks):
                    break  # keep arrival order: no one overtakes a request that does not fit
                blocked.add(tenant)
                continue
            chunks.append(chunk)
            step.take(seq, chunk.num_tokens, size)

    def _reserve(
        self, seq: SequenceState, num_tokens: int, scheduled: set[int]
    ) -> tuple[bool, bool]:
        """Blocks for `num_tokens` more of `seq`, preempting others as needed (`_victim`).

        Returns (reserved, whether anyone was preempted); `seq` itself may be the one preempted.
        """
        preempted = False
        while not self.kv.grow(seq.block_table, seq.num_computed_tokens + num_tokens):
            victim = self._victim(scheduled)
            self.preempt(victim)
            preempted = True
            if victim is seq:
                return False, True
        return True, preempted

    def _victim(self, scheduled: set[int]) -> SequenceState:
        """The running sequence to preempt for memory among those not planned yet: the least
        urgent, then of the tenant holding the most KV per unit of weight, then the latest."""
        held = blocks_per_weight(self.running)
        candidates = [
            (seq.request.priority, held[seq.request.tenant], order, seq)
            for order, seq in enumerate(self.running)
            if seq.seq_id not in scheduled
        ]
        return max(candidates, key=lambda c: c[:3])[3]

    def _preempt_for_priority(self, budget: int) -> None:
        """The most urgent waiting sequence takes the place of less urgent running ones while it
        could not be admitted otherwise (no sequence slot, or no KV room for its first chunk)."""
        if not self.waiting or not self.running:
            return
        head = self.waiting[0]
        while self.running and not self._could_admit(head, budget):
            victim = self._victim(set())
            if victim.request.priority <= head.request.priority:
                return  # no one less urgent runs
            self.preempt(victim)

    def _could_admit(self, seq: SequenceState, budget: int) -> bool:
        if len(self.running) >= self.max_num_seqs:
            return False
        prefix = self._prefix(seq)[0]
        num_tokens = min(seq.num_tokens - len(prefix) * self.kv.block_size, budget)
        return self.kv.can_admit(prefix, len(prefix) * self.kv.block_size + num_tokens)

    def _prefix(self, seq: SequenceState) -> tuple[list[int], list[int]]:
        """The computed blocks `seq` starts from (a sibling's or the cache's), and the cache's."""
        # A prompt to score is computed whole (a sibling computes the same, so sharing is fine).
        scores = seq.request.scores_prompt
        cache_hits = [] if scores else self.kv.cached_prefix(seq.hash_chain, seq.token_ids)
        shared = self._sibling_prefix(seq)
        return (shared if len(shared) > len(cache_hits) else cache_hits), cache_hits

    def _admit(self, seq: SequenceState, budget: int) -> ScheduledChunk | None:
        block_size = self.kv.block_size
        prefix, cache_hits = self._prefix(seq)
        num_computed = len(prefix) * block_size
        num_tokens = min(seq.num_tokens - num_computed, budget)
        if not self.kv.admit(seq.block_table, prefix, num_computed + num_tokens):
            return None
        if self.kv.enable_prefix_caching:
            self.kv.prefix_stats.record(seq.num_tokens, len(cache_hits) * block_size)
        seq.num_computed_tokens = num_computed
        seq.status = SeqStatus.RUNNING
        self.waiting.remove(seq)
        self.running.append(seq)
        return ScheduledChunk(seq, num_computed, num_tokens)

    def _adapter_fits(self, seq: SequenceState) -> bool:
        """Running `seq` keeps the running sequences within max_loras distinct adapters."""
        lora = seq.params.lora_request
        if lora is None or self.max_loras == 0:
            return True
        running = {s.params.lora_request for s in self.running} - {None}
        return lora in running or len(running) < self.max_loras

    def _shareable_blocks(self, seq: SequenceState) -> int:
        """Full blocks of the prompt `seq` could take from a sibling (its last token excluded)."""
        return min(seq.num_prompt_tokens, seq.num_tokens - 1) // self.kv.block_size

    def _sibling_prefix(self, seq: SequenceState) -> list[int]:
        limit = self._shareable_blocks(seq)
        best: list[int] = []
        for sibling in seq.request.samples.values():
            if sibling is seq or sibling.status is not SeqStatus.RUNNING:
                continue
            count = min(sibling.block_table.num_committed_blocks, limit)
            if count > len(best):
                best = sibling.block_table.block_ids[:count]
        return best

    def _waits_for_sibling(self, seq: SequenceState) -> bool:
        """A sibling is running but has not computed the prompt yet: wait and share it after."""
        limit = self._shareable_blocks(seq)
        return limit > 0 and any(
            sibling is not seq
            and sibling.status is SeqStatus.RUNNING
            and sibling.block_table.num_committed_blocks < limit
            for sibling in seq.request.samples.values()
        )
