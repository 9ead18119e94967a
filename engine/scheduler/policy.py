"""Who runs in the next step and how many tokens each: continuous batching under two budgets.

Running sequences go first, decodes before unfinished prefills, so a long prompt never stalls
the token stream of requests already generating. Waiting sequences are admitted after them, in
arrival order, while there is token budget, a sequence slot and KV room; a prompt larger than
the budget is prefilled in chunks over several steps. When a running sequence needs a block
and none is free, the most recently admitted running sequence is preempted by recompute: its
blocks go back to the pool and it waits again at the head of the queue, to be prefilled anew
(prompt + tokens so far) once there is room.

Samples of one request share the prompt's KV: while one sample prefills the prompt, its
siblings wait; then each is admitted holding references to the prompt's full, computed blocks
and computes only the rest (the partial last block, at least one token). This works with or
without the prefix cache and needs no copy-on-write, since shared blocks are never written.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from engine.kv.cache.block_manager import BlockManager
from engine.scheduler.requests import SeqStatus, SequenceState


class ScheduledChunk(NamedTuple):
    seq: SequenceState
    start: int  # first token position to compute
    num_tokens: int


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
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []  # in admission order
        self.num_preemptions = 0

    # ---- queue membership ----------------------------------------------------------------------

    def enqueue(self, seq: SequenceState) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: SequenceState) -> None:
        """Take `seq` out of its queue for good; a running one gives its blocks back at once."""
        if seq.status is SeqStatus.RUNNING:
            self.kv.free(seq.block_table)
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def preempt(self, seq: SequenceState, count: bool = True) -> None:
        """Drop `seq`'s KV and queue it first among the waiting, to be recomputed."""
        self.kv.free(seq.block_table)
        self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.needs_announce = True
        self.waiting.appendleft(seq)
        if count:
            self.num_preemptions += 1
            seq.request.num_preemptions += 1

    # ---- planning ------------------------------------------------------------------------------

    def plan(self) -> list[ScheduledChunk]:
        chunks: list[ScheduledChunk] = []
        budget = self.max_num_batched_tokens
        room = self.max_plan_bytes  # bytes left in the plan's frame
        scheduled: set[int] = set()
        preempted = False
        decoding = [seq for seq in self.running if seq.num_uncomputed_tokens == 1]
        prefilling = [seq for seq in self.running if seq.num_uncomputed_tokens > 1]
        for seq in decoding + prefilling:
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted for an earlier one this step
                continue
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            size = seq.plan_bytes(num_tokens, seq.num_computed_tokens + num_tokens)
            if size > room and chunks:
                break  # the frame is full: the rest run next step
            reserved, preempted_some = self._reserve(seq, num_tokens, scheduled)
            preempted = preempted or preempted_some
            if reserved:
                chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, num_tokens))
                scheduled.add(seq.seq_id)
                budget -= num_tokens
                room -= size
        if preempted and chunks:
            return chunks  # memory is short: admit no one until the running make progress
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            if self._waits_for_sibling(seq) or not self._adapter_fits(seq):
                continue  # a sequence of another adapter may go first
            # Cache hits are not known yet: count the whole table the sequence could need.
            size = seq.plan_bytes(min(seq.num_tokens, budget), seq.num_tokens)
            if size > room and chunks:
                break  # no room left in this plan's frame: admitted next step, in order
            chunk = self._admit(seq, budget)
            if chunk is None:
                break  # keep arrival order: no one overtakes a request that does not fit
            chunks.append(chunk)
            budget -= chunk.num_tokens
            room -= size
        return chunks

    def _reserve(
        self, seq: SequenceState, num_tokens: int, scheduled: set[int]
    ) -> tuple[bool, bool]:
        """Blocks for `num_tokens` more of `seq`, preempting the latest admitted as needed.

        Returns (reserved, whether anyone was preempted); `seq` itself may be the one preempted.
        """
        preempted = False
        while not self.kv.grow(seq.block_table, seq.num_computed_tokens + num_tokens):
            victim = next(s for s in reversed(self.running) if s.seq_id not in scheduled)
            self.preempt(victim)
            preempted = True
            if victim is seq:
                return False, True
        return True, preempted

    def _admit(self, seq: SequenceState, budget: int) -> ScheduledChunk | None:
        block_size = self.kv.block_size
        # A prompt to score is computed whole (a sibling computes the same, so sharing is fine).
        scores = seq.request.scores_prompt
        cache_hits = [] if scores else self.kv.cached_prefix(seq.hash_chain, seq.token_ids)
        shared = self._sibling_prefix(seq)
        prefix = shared if len(shared) > len(cache_hits) else cache_hits
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
