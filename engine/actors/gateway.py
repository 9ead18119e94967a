"""The gateway: the one place where every unfinished request's truth lives (DESIGN §5).

It runs in the root process. It assigns request ids and seeds, keeps each unfinished request's
record (prompt, params, what each sample has delivered to its client, epoch), fans detokenizer
output to per-request streams, and after a restart on the request path produces the resubmission
of every unfinished request under a new epoch. It does no I/O itself: the engine client sends
what it returns.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from engine.messages.outputs import OutputBatch, SampleDeltaText
from engine.messages.params import SamplingParams
from engine.messages.requests import ChatMessage, GenerateRequest, RequestFailed
from engine.messages.scheduling import AbortRequests, SampleResume
from engine.outputs import CompletionOutput, EngineError, RequestOutput


@dataclass
class SampleRecord:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def resume(self) -> SampleResume:
        return SampleResume(self.index, list(self.token_ids))


@dataclass
class RequestRecord:
    request_id: str
    params: SamplingParams
    seed: int
    prompt: str | None
    prompt_token_ids: list[int] | None
    messages: list[ChatMessage] | None
    samples: list[SampleRecord]
    stream: asyncio.Queue[RequestOutput | EngineError]
    epoch: int = 0
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None

    @property
    def finished(self) -> bool:
        return all(sample.finished for sample in self.samples)

    def state(self) -> str:
        if self.prompt_token_ids is None:
            return "tokenizing"
        return "prefilling" if self.first_token_at is None else "decoding"

    def submission(self) -> GenerateRequest:
        resume = None
        if self.epoch > 0:
            resume = [sample.resume() for sample in self.samples if not sample.finished]
        return GenerateRequest(
            request_id=self.request_id,
            epoch=self.epoch,
            params=self.params,
            seed=self.seed,
            prompt=self.prompt,
            # Once tokenized, a resubmission skips re-tokenizing (and cannot tokenize differently).
            prompt_token_ids=self.prompt_token_ids,
            messages=self.messages if self.prompt_token_ids is None else None,
            resume=resume,
        )


class Gateway:
    """Request registry; methods return the messages the caller must send to the tokenizer."""

    def __init__(self) -> None:
        self._records: dict[str, RequestRecord] = {}
        self._ids = itertools.count()
        self._id_prefix = secrets.token_hex(4)
        self.resubmissions = 0

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._records

    def open(
        self,
        params: SamplingParams,
        *,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        messages: list[ChatMessage] | None = None,
        request_id: str | None = None,
    ) -> tuple[RequestRecord, GenerateRequest]:
        """Register a new request; returns its record and the submission to send."""
        if request_id is None:
            request_id = f"req-{self._id_prefix}-{next(self._ids)}"
        elif request_id in self._records:
            raise EngineError(f"request id {request_id!r} is already in flight", 400, "request_id")
        # A seed is always chosen here so that a resubmitted request samples exactly as before.
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        record = RequestRecord(
            request_id=request_id,
            params=params,
            seed=seed,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            messages=messages,
            samples=[SampleRecord(i) for i in range(params.n)],
            stream=asyncio.Queue(),
        )
        self._records[request_id] = record
        return record, record.submission()

    def close(self, request_id: str, reason: str = "abort") -> AbortRequests | None:
        """Finish a request early (client abort or disconnect); returns the abort to send."""
        record = self._records.pop(request_id, None)
        if record is None:
            return None
        deltas = []
        for sample in record.samples:
            if not sample.finished:
                sample.finish_reason = reason
                deltas.append(CompletionOutput(sample.index, "", [], reason))
        record.stream.put_nowait(self._output(record, deltas, finished=True))
        return AbortRequests([request_id])

    def fail(self, request_id: str, error: EngineError) -> None:
        record = self._records.pop(request_id, None)
        if record is not None:
            record.stream.put_nowait(error)

    def fail_all(self, error: EngineError) -> None:
        for request_id in list(self._records):
            self.fail(request_id, error)

    def deliver(self, batch: OutputBatch) -> None:
        """Apply one detokenizer batch: outputs of a stale epoch are dropped."""
        for info in batch.prompts:
            record = self._current(info.request_id, info.epoch)
            if record is not None:
                record.prompt_token_ids = info.prompt_token_ids
        for failure in batch.failures:
            if self._current(failure.request_id, failure.epoch) is not None:
                self.fail(failure.request_id, _engine_error(failure))
        by_request: dict[str, list[SampleDeltaText]] = {}
        for delta in batch.samples:
            by_request.setdefault(delta.request_id, []).append(delta)
        for request_id, deltas in by_request.items():
            record = self._current(request_id, deltas[0].epoch)
            if record is not None:
                self._apply(record, deltas)

    def resubmit_all(self) -> list[GenerateRequest]:
        """After a restart on the request path: every unfinished request, under a new epoch."""
        submissions = []
        for record in self._records.values():
            record.epoch += 1
            submissions.append(record.submission())
        self.resubmissions += len(submissions)
        return submissions

    def records(self) -> Iterable[RequestRecord]:
        return self._records.values()

    def describe(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [
            {
                "request_id": r.request_id,
                "state": r.state(),
                "epoch": r.epoch,
                "prompt_tokens": len(r.prompt_token_ids or []),
                "generated_tokens": sum(len(s.token_ids) for s in r.samples),
                "age_s": round(now - r.arrival, 3),
            }
            for r in self._records.values()
        ]

    def _current(self, request_id: str, epoch: int) -> RequestRecord | None:
        record = self._records.get(request_id)
        if record is None or record.epoch != epoch:
            return None
        return record

    def _apply(self, record: RequestRecord, deltas: list[SampleDeltaText]) -> None:
        outputs = []
        for delta in deltas:
            sample = record.samples[delta.index]
            if sample.finished:
                continue
            sample.token_ids.extend(delta.token_ids)
            sample.text_parts.append(delta.text)
            sample.finish_reason = delta.finish_reason
            logprobs = None
            if delta.logprobs is not None:
                logprobs = [
                    {
                        "token_id": lp.token_id,
                        "token": lp.token,
                        "logprob": lp.logprob,
                        "top_logprobs": [
                            {"token_id": t.token_id, "token": t.token, "logprob": t.logprob}
                            for t in lp.top
                        ],
                    }
                    for lp in delta.logprobs
                ]
            outputs.append(
                CompletionOutput(
                    delta.index, delta.text, list(delta.token_ids), delta.finish_reason, logprobs
                )
            )
        if not outputs:
            return
        if record.first_token_at is None:
            record.first_token_at = time.monotonic()
        finished = record.finished
        if finished:
            del self._records[record.request_id]
        record.stream.put_nowait(self._output(record, outputs, finished))

    @staticmethod
    def _output(
        record: RequestRecord, outputs: list[CompletionOutput], finished: bool
    ) -> RequestOutput:
        return RequestOutput(
            request_id=record.request_id,
            prompt=record.prompt,
            prompt_token_ids=list(record.prompt_token_ids or []),
            outputs=outputs,
            finished=finished,
        )


def _engine_error(failure: RequestFailed) -> EngineError:
    return EngineError(failure.message, failure.status, failure.param)
