"""The scheduler's domain object: requests in, one StepPlan per step out, tokens back.

The actor around it calls, in a loop: `add` / `abort` / `stop_samples` for each inbound message,
`schedule()` whenever no step is in flight (one step at a time: a plan's results must be back
through `update` before the next plan), and `update(result)` for each StepResult, forwarding the
TokenBatch it returns. Plain Python, no I/O.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

import msgspec

from engine.kv.cache.block_manager import BlockManager
from engine.kv.cache.prefix_index import PrefixIndex
from engine.kv.disk.orders import DiskEvent, DiskOrder
from engine.messages.failures import RequestFailed
from engine.messages.scheduling import (
    RequestStatus,
    SampleDelta,
    SchedulerStats,
    StopSamples,
    SubmitRequest,
    TokenBatch,
)
from engine.messages.steps import NewRequest, NewSeq, StepPlan, StepResult
from engine.scheduler.admission import announcement_too_large, failed, rejection_reason
from engine.scheduler.config import SchedulerConfig
from engine.scheduler.disk_tier import disk_tier_for
from engine.scheduler.kv_handoff import KvTransfer
from engine.scheduler.policy import BatchPlanner, ScheduledChunk
from engine.scheduler.reporting import request_statuses, scheduler_stats
from engine.scheduler.requests import Request, SequenceState, sample_starts
from engine.scheduler.speculation import Proposal, Speculator, parse_speculative_config
from engine.scheduler.step_parts import checked_logprobs, is_result_of, planned_chunk, sample_delta
from engine.scheduler.stopping import finish_reason

log = logging.getLogger(__name__)


class _InFlight(NamedTuple):
    step_id: int
    chunks: list[ScheduledChunk]
    sampled_seq_ids: set[int]
    proposed: dict[int, int]  # seq id -> tokens proposed after its decode token (speculation)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        clock: Callable[[], float] = time.monotonic,
        first_id: int = 0,
        prefix_index: PrefixIndex | None = None,
        on_disk: Callable[[bytes], bool] | None = None,
    ) -> None:
        """`first_id`: where step and sequence ids start; a restarted scheduler starts past its
        predecessor's, so that a late result of a dead one's step never passes for one of its
        own (the workers outlive it). `prefix_index`: the prefix cache's lasting record.
        `on_disk`: the prefix cache's disk tier has a block of this key (None: no tier)."""
        config.validate()
        self.config, self.clock = config, clock
        caching = config.enable_prefix_caching
        self.kv = BlockManager(config.num_blocks, config.block_size, caching, prefix_index)
        limits = (config.max_num_seqs, config.max_num_batched_tokens, config.max_plan_bytes)
        self.planner = BatchPlanner(self.kv, *limits, config.max_loras)
        self._eos_token_ids = frozenset(config.eos_token_ids)
        speculation = parse_speculative_config(config.speculative_config)
        drafted = speculation is not None and speculation.kind == "draft_model"
        pd = config.kv_transfer_ranks > 0
        self._window = 0 if pd or drafted else config.sliding_window  # released blocks' rule
        self._length_limits = (config.max_model_len, config.default_max_tokens)  # finish_reason's
        self._requests: dict[str, Request] = {}
        self._seqs: dict[int, SequenceState] = {}
        self._next_seq_id = first_id
        self._next_step_id = first_id
        self._next_request_key = first_id
        self._in_flight: _InFlight | None = None
        self._retired_seq_ids: list[int] = []  # workers drop them with the next plan
        self._retired_request_keys: list[int] = []  # ... and these requests
        self._outbox: list[SampleDelta] = []  # finishes decided outside a step
        self.num_steps = 0
        # P/D disaggregation: KV holds and pulls, when this instance has kv_transfer actors.
        self.kv_transfer = (
            KvTransfer(self.kv, config.kv_transfer_ranks, config.kv_hold_timeout, clock)
            if config.kv_transfer_ranks
            else None
        )
        speculative = parse_speculative_config(config.speculative_config)
        self.speculator = (
            None if speculative is None else Speculator(speculative, self.kv, *self._length_limits)
        )
        self.disk = None if on_disk is None or not caching else disk_tier_for(self.kv, on_disk)

    # ---- inbound -------------------------------------------------------------------------------

    def add(self, submit: SubmitRequest, held: list[int] | None = None) -> RequestFailed | None:
        """Queue a request (or replace an older epoch of it); reject one that can never run.

        A request with a KV source waits (in `kv_transfer.pulls`) until its KV has arrived or
        failed to; `admit_pulled` then queues it. One whose prefix is on disk waits while it is
        read; `on_disk_event` then queues it with the prefix blocks it `held` until planned."""
        if self.kv_transfer is not None:
            self.kv_transfer.pulls.cancel(submit.request_id)
        if self.disk is not None and held is None:
            self.disk.cancel(submit.request_id)
        existing = self._requests.get(submit.request_id)
        if existing is not None:
            if submit.epoch <= existing.epoch:
                log.warning(
                    "ignoring request %s epoch %d: epoch %d is already queued",
                    submit.request_id,
                    submit.epoch,
                    existing.epoch,
                )
                return None
            self._drop_request(existing)
        reason = rejection_reason(
            submit, self.config.max_model_len, self.config.max_plan_bytes // 2
        )
        if reason is not None:
            return failed(submit.request_id, submit.epoch, 400, reason, "scheduler")
        pulls = None if self.kv_transfer is None else self.kv_transfer.pulls
        if submit.kv_source is not None and pulls is not None and pulls.begin(submit):
            return None
        request = Request.of(submit, self.clock(), self._next_request_key)
        self._next_request_key += 1
        reason = announcement_too_large(request, self.config.max_plan_bytes // 2)
        if reason is not None:
            return failed(submit.request_id, submit.epoch, 400, reason, "scheduler")
        if held is None and self.disk is not None and self.disk.begin_load(submit):
            return None
        request.held_blocks = held or []
        self._queue_samples(request, submit)
        return None

    def _queue_samples(self, request: Request, submit: SubmitRequest) -> None:
        """A sequence per sample still to finish (a resumed request's carry their delivered
        tokens), queued for the planner."""
        starts = sample_starts(submit)
        self._requests[request.request_id] = request  # first, so abort() can undo a partial add
        for index, delivered in starts:
            seq = SequenceState(
                self._next_seq_id, request, index, delivered, self.config.block_size
            )
            self._next_seq_id += 1
            done = (
                finish_reason(seq, self._eos_token_ids, *self._length_limits) if delivered else None
            )
            if done is not None:  # the delivered tokens already end it (its finish got lost)
                self._outbox.append(
                    SampleDelta(request.request_id, request.epoch, index, [], None, done)
                )
                continue
            request.samples[index] = seq
            self._seqs[seq.seq_id] = seq
            self.planner.enqueue(seq)
        if not request.samples:  # nothing left to compute
            del self._requests[request.request_id]
            self.kv.release_held(request.held_blocks)
        elif submit.params.prompt_logprobs is not None and not any(d for _, d in starts):
            request.prompt_scores = {}  # none were delivered yet: compute them

    def admit_pulled(self, submits: Iterable[SubmitRequest]) -> list[RequestFailed]:
        """Queue requests whose KV pull settled (arrived: its blocks are cached prefix now)."""
        return self._admit((msgspec.structs.replace(s, kv_source=None), None) for s in submits)

    def on_disk_event(self, event: DiskEvent) -> list[RequestFailed]:
        """A disk order's outcome; the requests that waited for it are queued now."""
        assert self.disk is not None
        return self._admit(self.disk.on_event(event))

    def _admit(
        self, waited: Iterable[tuple[SubmitRequest, list[int] | None]]
    ) -> list[RequestFailed]:
        return [f for submit, held in waited if (f := self.add(submit, held)) is not None]

    def abort(self, request_ids: Iterable[str]) -> None:
        """Drop these requests now; their blocks return to the pool at once."""
        for request_id in request_ids:
            if self.kv_transfer is not None:
                self.kv_transfer.pulls.cancel(request_id)
            if self.disk is not None:
                self.disk.cancel(request_id)
            request = self._requests.get(request_id)
            if request is not None:
                self._drop_request(request)

    def stop_samples(self, stop: StopSamples) -> None:
        """Finish some samples of the current epoch of a request (matched a stop string)."""
        request = self._requests.get(stop.request_id)
        if request is None or request.epoch != stop.epoch:
            return
        for index in stop.indices:
            seq = request.samples.get(index)
            if seq is not None:
                self._retire(seq)

    def fail(self, seq_ids: Iterable[int], message: str, status: int = 500) -> list[RequestFailed]:
        """Drop the requests of sequences the workers could not compute; their failures."""
        failures = []
        for seq_id in seq_ids:
            seq = self._seqs.get(seq_id)
            if seq is not None:
                request = seq.request
                self._drop_request(request)
                failures.append(
                    failed(request.request_id, request.epoch, status, message, "worker")
                )
        return failures

    def on_workers_restarted(self) -> None:
        """The workers lost their sequences, and their KV unless it outlives them (then what is
        indexed stays: only steps that came back index blocks); the requests go again."""
        self._in_flight = None
        for seq in reversed(list(self.planner.running)):
            self.planner.preempt(seq, count=False)
        for seq in self._seqs.values():
            seq.needs_announce = True
            seq.known_to_workers = False
        for request in self._requests.values():
            request.known_to_workers = False
        self._retired_seq_ids.clear()
        self._retired_request_keys.clear()
        if self.kv_transfer is not None:
            self.kv_transfer.on_workers_restarted()
        if not self.config.kv_outlives_workers:
            self.kv.reset_prefix_cache()

    # ---- steps ---------------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """The next step's plan; None if a step is in flight or there is nothing to say.

        A plan without chunks only retires sequences; it expects no StepResult.
        """
        if self._in_flight is not None:
            return None
        chunks = self.planner.plan()
        if not chunks and not self._retired_seq_ids and not self._retired_request_keys:
            return None
        proposals = self._proposals(chunks)
        step_id = self._next_step_id
        self._next_step_id += 1
        new_requests: list[NewRequest] = []
        new_seqs: list[NewSeq] = []
        planned = []
        sampled: set[int] = set()
        for chunk in chunks:
            seq = chunk.seq
            if seq.request.first_scheduled is None:
                seq.request.first_scheduled = self.clock()
                seq.request.num_cached_tokens = chunk.start  # what admission found computed
                self.kv.release_held(seq.request.held_blocks)  # its table holds its prefix now
            if seq.needs_announce:
                if not seq.request.known_to_workers:
                    new_requests.append(seq.request.announcement())
                    seq.request.known_to_workers = True
                new_seqs.append(seq.announcement())
                seq.needs_announce = False
                seq.known_to_workers = True
                seq.blocks_sent = 0
            planned.append(planned_chunk(chunk, proposals.get(seq.seq_id, Proposal([]))))
            if planned[-1].sample:
                sampled.add(seq.seq_id)
        plan = StepPlan(
            step_id,
            new_requests,
            new_seqs,
            planned,
            self._retired_seq_ids,
            self._retired_request_keys,
        )
        self._retired_seq_ids = []
        self._retired_request_keys = []
        if chunks:
            proposed = {seq_id: proposal.size for seq_id, proposal in proposals.items()}
            self._in_flight = _InFlight(step_id, chunks, sampled, proposed)
        return plan

    def _record_computed(self, step: _InFlight, sampled_seq_ids: list[int]) -> None:
        """The step's chunks have KV now, and so have the proposals accepted (the rejected
        ones' slots are written again later); the blocks of accepted tokens are indexed by the
        next step's commit, once the tokens are in token_ids."""
        accepted = {}
        if step.proposed and self.speculator is not None:
            accepted = self.speculator.accepted(step.proposed, sampled_seq_ids)
        for chunk in step.chunks:
            seq = chunk.seq
            if self._seqs.get(seq.seq_id) is seq:  # not dropped while the step ran
                end = chunk.start + chunk.num_tokens
                seq.num_computed_tokens = end + accepted.get(seq.seq_id, 0)
                indexed = self.kv.commit(seq.block_table, seq.hash_chain, seq.token_ids, end)
                if self.disk is not None:
                    self.disk.indexed(indexed)
                if self._window:
                    first = seq.num_computed_tokens - self._window + 1
                    self.kv.release_before(seq.block_table, first)

    def _proposals(self, chunks: list[ScheduledChunk]) -> dict[int, Proposal]:
        """Speculative decoding's proposals for the step's decode chunks, by sequence id."""
        if self.speculator is None:
            return {}
        budget = self.config.max_num_batched_tokens - sum(chunk.num_tokens for chunk in chunks)
        return self.speculator.plan(chunks, budget)

    def update(self, result: StepResult) -> TokenBatch:
        """Apply a step's sampled tokens; returns every sample's new tokens and finishes."""
        items = self._outbox
        self._outbox = []
        step = self._in_flight
        if not is_result_of(result, None if step is None else step.step_id):
            return TokenBatch(items)
        assert step is not None
        self._in_flight = None
        self.num_steps += 1
        self._record_computed(step, result.seq_ids)
        for scores in result.prompt_logprobs or []:
            scored = self._seqs.get(scores.seq_id)
            if scored is not None:
                scored.request.add_prompt_scores(scores)
        logprobs = checked_logprobs(result)
        for position, seq_id in enumerate(result.seq_ids):
            sampled = self._seqs.get(seq_id)
            if sampled is None or seq_id not in step.sampled_seq_ids:
                continue  # a sequence dropped (aborted, replaced) while the step ran
            seq = sampled
            seq.token_ids.append(result.token_ids[position])
            reason = finish_reason(seq, self._eos_token_ids, *self._length_limits)
            kv = self.kv_transfer
            handoff = kv.hand_off(seq, reason) if kv and seq.request.kv_handoff else None
            items.append(
                sample_delta(seq, result, position, logprobs, reason, handoff, self.clock())
            )
            if reason is not None or handoff is not None:
                self._retire(seq)
        return TokenBatch(items)

    def take_outputs(self) -> TokenBatch | None:
        """Finishes decided outside a step (by `add`), if any; `update` includes them too."""
        if not self._outbox:
            return None
        items, self._outbox = self._outbox, []
        return TokenBatch(items)

    def take_disk_orders(self) -> list[DiskOrder]:
        return [] if self.disk is None else self.disk.take_orders()

    # ---- state ---------------------------------------------------------------------------------

    @property
    def has_unfinished_requests(self) -> bool:
        pulling = self.kv_transfer is not None and self.kv_transfer.pulls.num_pending > 0
        reading = self.disk is not None and self.disk.num_waiting > 0
        return bool(self._requests) or pulling or reading

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def stats(self) -> SchedulerStats:
        parts = {
            **(self.speculator.tally.figures() if self.speculator is not None else {}),
            **(self.disk.stats() if self.disk is not None else {}),
        }
        counts = (len(self._requests), self.num_steps)
        return scheduler_stats(self.kv, self.planner, counts, self.kv_transfer, parts)

    def request_statuses(self) -> list[RequestStatus]:
        return request_statuses(self._requests.values(), self.clock())

    # ---- internals -----------------------------------------------------------------------------

    def _retire(self, seq: SequenceState) -> None:
        """Forget a finished or dropped sample; its request goes when its last sample does."""
        self.planner.remove(seq)
        if self.speculator is not None:
            self.speculator.forget(seq.seq_id)
        del self._seqs[seq.seq_id]
        if seq.known_to_workers:
            self._retired_seq_ids.append(seq.seq_id)
        request = seq.request
        del request.samples[seq.index]
        if not request.samples and self._requests.get(request.request_id) is request:
            self._forget(request)

    def _drop_request(self, request: Request) -> None:
        for seq in list(request.samples.values()):
            self._retire(seq)
        if self._requests.get(request.request_id) is request:
            self._forget(request)

    def _forget(self, request: Request) -> None:
        """The request is done here; the workers forget it with the next plan."""
        del self._requests[request.request_id]
        self.kv.release_held(request.held_blocks)
        if request.known_to_workers:
            request.known_to_workers = False
            self._retired_request_keys.append(request.key)
