"""The gateway: the one place where every unfinished request's truth lives, so that an actor's
restart loses no request.

It runs in the root process. It assigns request ids and seeds, keeps each unfinished request's
record (prompt, params, what each sample has delivered to its client, epoch), fans detokenizer
output to per-request streams, and after a restart on the request path produces the resubmission
of every unfinished request under a new epoch. The ids of a text prompt come from the tokenizer,
on a ring of their own: a request's outputs reach its client only once they are known. It does
no I/O itself: the engine client sends what it returns (and what `take_submissions` hands out).

A request that crashes an actor every time it gets there is retried alone (probation) and then
quarantined: the rules are in docs/architecture.md, "Nothing in flight is lost".
"""

from __future__ import annotations

import itertools
import logging
import random
import secrets
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable

import msgspec

from engine.inflight.deltas import join_deltas
from engine.inflight.output_stream import OutputStream
from engine.inflight.records import RequestRecord, SampleRecord
from engine.messages.admin import RequestRow
from engine.messages.kv_transfer import KvSource
from engine.messages.outputs import OutputBatch, SampleDeltaText
from engine.messages.requests import EngineRequest, GenerateRequest, PromptTokens
from engine.messages.scheduling import AbortRequests
from engine.request.outputs import CompletionOutput, EngineError

log = logging.getLogger(__name__)

ToTokenizer = GenerateRequest | AbortRequests


class Gateway:
    """Request registry; methods return the messages the caller must send to the tokenizer."""

    def __init__(
        self,
        quarantine_after: int = 2,
        *,
        stream_buffer: int = 64,
        stalled_stream_timeout: float = 60.0,
        seed: int | None = None,
    ) -> None:
        """`seed`: where the seeds of requests that bring none are drawn from (model.seed: the
        same requests in the same order sample the same outputs in every run); None: at random."""
        if quarantine_after < 1:
            raise ValueError(f"quarantine_after must be an integer >= 1, got {quarantine_after}")
        self.quarantine_after = quarantine_after
        self.stream_buffer = stream_buffer
        self.stalled_stream_timeout = stalled_stream_timeout
        self._stalled: list[str] = []  # requests aborted for a stalled client; abort owed
        self._records: dict[str, RequestRecord] = {}
        self._ids = itertools.count()
        self._seeds = random.Random(seed)
        self._id_prefix = secrets.token_hex(4)
        self._suspects: deque[str] = deque()  # waiting for probation, oldest first
        self._probationer: str | None = None  # the suspect now in flight alone
        self._outbox: list[ToTokenizer] = []  # owed submissions (probation turns, releases)
        self.resubmissions = 0
        self.handoffs = 0  # P/D: requests handed from a prefill replica to a decode one
        # One-launch P/D: a handed-off request goes on here (to a decode replica); else the
        # handoff is the client's to take to a decode instance (kv_transfer_params).
        self.hands_on_locally = False
        self.quarantined = 0
        self.stalled_aborts = 0
        # Called with each record as it leaves (finished, failed, aborted): the request tracer
        self.on_request_end: Callable[[RequestRecord], None] | None = None

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._records

    @property
    def on_probation(self) -> bool:
        """A suspect is being retried alone: every other request is held back."""
        return self._probationer is not None or bool(self._suspects)

    def register(self, request: EngineRequest) -> tuple[RequestRecord, GenerateRequest | None]:
        """Register a new request (its policy applied); its record and the submission to send
        (None: held back while a suspect is on probation; it is sent when probation ends). A
        request without an id gets one here."""
        if request.request_id is None:
            request.request_id = f"req-{self._id_prefix}-{next(self._ids)}"
        elif request.request_id in self._records:
            raise EngineError(
                f"request id {request.request_id!r} is already in flight", 400, "request_id"
            )
        params = request.params
        # A seed is always chosen here so that a resubmitted request samples exactly as before.
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        record = RequestRecord(
            request=request,
            seed=seed,
            samples=[SampleRecord(i) for i in range(params.n)],
            stream=OutputStream(self.stream_buffer),
            held=self.on_probation,
        )
        self._records[request.request_id] = record
        return record, None if record.held else record.submission()

    def abort(self, request_id: str, reason: str = "abort") -> AbortRequests | None:
        """Finish a request early (client abort or disconnect); returns the abort to send."""
        record = self._records.pop(request_id, None)
        if record is None:
            return None
        deltas = []
        for sample in record.samples:
            if not sample.finished:
                sample.finish_reason = reason
                deltas.append(CompletionOutput(sample.index, "", [], reason))
        record.stream.put_nowait(record.output(deltas, finished=True))
        self._forget(record)
        return AbortRequests([request_id])

    def fail(self, request_id: str, error: EngineError) -> None:
        record = self._records.pop(request_id, None)
        if record is not None:
            record.failure = error.message
            record.stream.put_nowait(error)
            self._forget(record)

    def fail_all(self, error: EngineError) -> None:
        self._suspects.clear()
        self._probationer = None
        for request_id in list(self._records):
            self.fail(request_id, error)

    def deliver(self, batch: OutputBatch) -> None:
        """Apply one detokenizer batch: outputs of a stale epoch are dropped, and those that
        came before the ids of their text prompt wait for them (`learn_prompt`)."""
        for started in batch.started:
            record = self._current(started.request_id, started.epoch)
            if record is not None:
                record.acknowledged = True
        for failure in batch.failures:
            if self._current(failure.request_id, failure.epoch) is not None:
                self.fail(failure.request_id, EngineError.from_failure(failure))
        # By epoch too: a late delta of the epoch a resubmission replaced may share a batch
        # with the new epoch's first ones, which must not be dropped with it.
        by_request: dict[tuple[str, int], list[SampleDeltaText]] = {}
        for delta in batch.samples:
            by_request.setdefault((delta.request_id, delta.epoch), []).append(delta)
        for (request_id, epoch), deltas in by_request.items():
            record = self._current(request_id, epoch)
            if record is not None and record.prompt_token_ids is None:
                record.early += deltas
            elif record is not None:
                self._apply(record, deltas)

    def learn_prompt(self, prompt: PromptTokens) -> None:
        """The tokenizer's ids of a text prompt: kept for every resubmission (never tokenized
        again) and every output; the outputs that came before them go now."""
        record = self._current(prompt.request_id, prompt.epoch)
        if record is None or record.prompt_token_ids is not None:
            return
        record.request.prompt_token_ids = prompt.prompt_token_ids
        if record.request.tokenize_only:  # all it asked for
            del self._records[record.request_id]
            record.stream.put_nowait(record.output([], finished=True))
            self._forget(record)
            return
        early, record.early = record.early, []
        if early:
            self._apply(record, early)

    def record_crash(self, actor: str, reason: str, *, tokenizer: bool = False) -> list[str]:
        """Count a crash of `actor` against the requests in flight at it (see the module doc);
        `tokenizer`: the actor is a tokenizer, which only holds requests not yet passed on.
        Returns the ids of the requests this crash quarantined (their streams got the error)."""
        at_actor = [
            record
            for record in self._records.values()
            if not record.held and not (tokenizer and record.acknowledged)
        ]
        alone = len(at_actor) == 1
        quarantined = []
        for record in at_actor:
            record.strikes += 1
            if alone and record.strikes >= self.quarantine_after:
                quarantined.append(record.request_id)
                self._quarantine(record, actor, reason)
                continue
            if record.suspect_epoch is None and record.request_id != self._probationer:
                self._suspects.append(record.request_id)
            record.suspect_epoch = record.epoch
        if at_actor:
            log.warning(
                "%s crashed (%s) with %d request(s) in flight at it: %s",
                actor,
                reason,
                len(at_actor),
                "quarantined" if quarantined else "suspects, to be retried alone",
            )
        return quarantined

    def lost_with_tokenizer(self) -> set[str]:
        """What a restarted tokenizer may have lost: the requests not acknowledged under their
        current epoch (it keeps nothing of a request it has passed on), and those whose text it
        tokenized without the gateway receiving the ids (its rings start afresh)."""
        records = self._records.values()
        return {r.request_id for r in records if not r.acknowledged or r.prompt_token_ids is None}

    def resubmit_all(self, only: Collection[str] | None = None) -> list[ToTokenizer]:
        """After a restart on the request path: every unfinished request, under a new epoch.

        While suspects are on probation only the probationer goes; the others are held back,
        and whatever older epoch of theirs is still running is aborted.

        `only`: the requests the restart concerned (one data-parallel replica's, or those a
        restarted tokenizer may have held); the others run on under their epoch. Probation is
        engine-wide, so while it is under way, or a release is still owed, `only` is ignored
        and every request goes as above.
        """
        if only is not None and not self._in_probation_or_owed():
            records = [record for record in self._records.values() if record.request_id in only]
            for record in records:
                record.next_epoch(resubmitted=True)
            self.resubmissions += len(records)
            return [record.submission() for record in records]
        self._outbox.clear()  # whatever was owed goes in this resubmission, or stays held
        for record in self._records.values():
            record.next_epoch(resubmitted=True)
        if self._probationer is None:
            self._next_probationer()
        if not self.on_probation:
            for record in self._records.values():
                record.held = False
            submissions: list[ToTokenizer] = [r.submission() for r in self._records.values()]
            self.resubmissions += len(submissions)
            return submissions
        held = []
        for record in self._records.values():
            if record.request_id != self._probationer:
                record.held = True
                held.append(record.request_id)
        out: list[ToTokenizer] = [AbortRequests(held)] if held else []
        probationer = self._records.get(self._probationer or "")
        if probationer is not None:
            out.append(probationer.submission())
            self.resubmissions += 1
        return out

    def take_submissions(self) -> list[ToTokenizer]:
        """Messages owed since the last call (probation moved on or ended, streams found
        stalled, P/D handoffs); send them. A request that ended meanwhile (aborted) is not."""
        out = [
            message
            for message in self._outbox
            if not isinstance(message, GenerateRequest) or message.request_id in self._records
        ]
        self._outbox = []
        if self._stalled:
            out.append(AbortRequests(self._stalled))
            self._stalled = []
        return out

    def records(self) -> Iterable[RequestRecord]:
        return self._records.values()

    def describe(self) -> list[RequestRow]:
        now = time.monotonic()
        return [record.row(now) for record in self._records.values()]

    def _current(self, request_id: str, epoch: int) -> RequestRecord | None:
        record = self._records.get(request_id)
        return record if record is not None and record.epoch == epoch else None

    # ---- probation -----------------------------------------------------------------------------

    def _quarantine(self, record: RequestRecord, actor: str, reason: str) -> None:
        self.quarantined += 1
        message = (
            f"request {record.request_id} was quarantined: it was in flight at {record.strikes} "
            f"actor crashes, the last of them ({actor}: {reason}) while it was the only request "
            f"in flight there (runtime.quarantine_after is {self.quarantine_after}); "
            "it will not be retried"
        )
        log.error("%s", message)
        self.fail(record.request_id, EngineError(message, 500))

    def _clear(self, record: RequestRecord) -> None:
        """A suspect made progress after its crash: it is no suspect any more."""
        record.suspect_epoch = None
        record.strikes = 0
        if record.request_id == self._probationer:
            self._probationer = None
            if any(self._is_suspect(request_id) for request_id in self._suspects):
                self._hold(record)  # the next suspect must be alone in the engine
            self._advance()

    def _hold(self, record: RequestRecord) -> None:
        """Take a running request out of the engine until probation ends; it resumes then from
        what its client has (its running epoch's late outputs are dropped)."""
        record.held = True
        record.next_epoch()
        self._outbox.append(AbortRequests([record.request_id]))

    def _in_probation_or_owed(self) -> bool:
        held = any(record.held for record in self._records.values())
        return self.on_probation or bool(self._outbox) or held

    def _is_suspect(self, request_id: str) -> bool:
        record = self._records.get(request_id)
        return record is not None and record.suspect_epoch is not None

    def _forget(self, record: RequestRecord) -> None:
        """`record` left the registry (finished, failed, aborted)."""
        if self.on_request_end is not None:
            self.on_request_end(record)
        if record.request_id == self._probationer:
            self._probationer = None
            self._advance()

    def _next_probationer(self) -> RequestRecord | None:
        while self._suspects:
            request_id = self._suspects.popleft()
            if self._is_suspect(request_id):
                record = self._records[request_id]
                self._probationer = request_id
                record.held = False
                return record
        return None

    def _advance(self) -> None:
        """The probationer is done: send the next suspect alone, or release everyone."""
        record = self._next_probationer()
        if record is not None:
            self._outbox.append(record.submission())
            return
        for record in self._records.values():
            if record.held:
                record.held = False
                self._outbox.append(record.submission())

    def _apply(self, record: RequestRecord, deltas: list[SampleDeltaText]) -> None:
        outputs, handoff = join_deltas(record, deltas)
        if handoff is not None and self.hands_on_locally and not record.finished:
            self._hand_on(record, handoff)
        elif handoff is not None and not self.hands_on_locally:  # for a decode instance
            record.kv_transfer_params = msgspec.to_builtins(handoff)
        if not outputs:
            return
        finished = record.finished
        if finished:
            del self._records[record.request_id]
        record.stream.put_nowait(record.output(list(outputs.values()), finished))
        if finished:
            self._forget(record)
        elif record.stream.stalled_for() > self.stalled_stream_timeout:
            self._abort_stalled(record)
        elif record.suspect_epoch is not None and record.epoch > record.suspect_epoch:
            self._clear(record)

    def _hand_on(self, record: RequestRecord, source: KvSource) -> None:
        """P/D: the prefill replica is done with the request; it goes on (next epoch) wherever
        the router sends a request past its first token, a decode replica, to pull its KV."""
        record.next_epoch()
        self.handoffs += 1
        self._outbox.append(record.submission(kv_source=source))

    def _abort_stalled(self, record: RequestRecord) -> None:
        """Its client has left a full stream unread past the timeout: stop generating for it
        (its KV blocks are freed); the client gets what was generated, then finish "abort"."""
        log.warning(
            "request %s aborted: its client has not read its full output buffer (%d outputs) "
            "for %.0f s (server.stalled_stream_timeout)",
            record.request_id,
            self.stream_buffer,
            self.stalled_stream_timeout,
        )
        self.abort(record.request_id)
        self.stalled_aborts += 1
        self._stalled.append(record.request_id)
