"""What the registry keeps of each unfinished request: the truth a resubmission is built from.

The request itself is the EngineRequest its front end built (the policy applied, an id given):
kept as it is, and sent as it is in each submission, never copied field by field."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine.inflight.output_stream import OutputStream
from engine.messages.admin import RequestRow
from engine.messages.kv_transfer import KvSource
from engine.messages.outputs import SampleDeltaText, SampleLogprobs
from engine.messages.params import SamplingParams
from engine.messages.requests import EngineRequest, GenerateRequest
from engine.messages.scheduling import FirstScheduled, SampleResume
from engine.request.outputs import CompletionOutput, RequestOutput


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
    request: EngineRequest  # its request_id set; prompt_token_ids learnt from the tokenizer
    seed: int
    samples: list[SampleRecord]
    stream: OutputStream
    epoch: int = 0
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    acknowledged: bool = False  # the detokenizer has seen the current epoch (past the tokenizer)
    # Outputs of the current epoch that came before the ids of its text prompt (they come on
    # another ring, from the tokenizer): its client gets them with the ids.
    early: list[SampleDeltaText] = field(default_factory=list)
    held: bool = False  # held back at the gateway while a suspect is on probation
    strikes: int = 0  # crashes it was in flight at since it last made progress
    suspect_epoch: int | None = None  # its epoch when it last became a suspect; None: cleared
    first: FirstScheduled | None = None  # the scheduler's first report (cache hits, times)
    # When asked for, once computed: None for the first prompt token (as vLLM), then each one's.
    prompt_logprobs: list[SampleLogprobs | None] | None = None
    # P/D across instances: the kv_transfer_params a prefill instance answers with once it
    # holds the prompt's KV for a decode instance.
    kv_transfer_params: dict[str, Any] | None = None
    # For its trace span (engine/telemetry/): when it was resubmitted after restarts
    # (monotonic), and why it failed if it did.
    resubmitted_at: list[float] = field(default_factory=list)
    failure: str | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id or ""

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def prompt_token_ids(self) -> list[int] | None:
        return self.request.prompt_token_ids

    def output(self, outputs: list[CompletionOutput], finished: bool) -> RequestOutput:
        """What its stream gets next: `outputs`, with what is known of the whole request."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.request.prompt,
            prompt_token_ids=list(self.prompt_token_ids or []),
            outputs=outputs,
            finished=finished,
            num_cached_tokens=None if self.first is None else self.first.num_cached_tokens,
            scheduling=self.first,
            prompt_logprobs=self.prompt_logprobs,
            kv_transfer_params=self.kv_transfer_params,
        )

    @property
    def finished(self) -> bool:
        return all(sample.finished for sample in self.samples)

    def state(self) -> str:
        if self.held:
            return "held"
        if self.prompt_token_ids is None:
            return "tokenizing"
        return "prefilling" if self.first_token_at is None else "decoding"

    def row(self, now: float) -> RequestRow:
        """What the admin `requests` command shows of it."""
        return RequestRow(
            request_id=self.request_id,
            state=self.state(),
            epoch=self.epoch,
            prompt_tokens=len(self.prompt_token_ids or []),
            generated_tokens=sum(len(sample.token_ids) for sample in self.samples),
            strikes=self.strikes,
            age_s=round(now - self.arrival, 3),
        )

    def next_epoch(self, *, resubmitted: bool = False) -> None:
        """A new attempt: outputs of the old epoch are dropped from now on, and the tokenizer
        has yet to pass this one on. `resubmitted`: after a restart (timed for the trace)."""
        self.epoch += 1
        self.acknowledged = False
        self.early = []
        if resubmitted:
            self.resubmitted_at.append(time.monotonic())

    def submission(self, kv_source: KvSource | None = None) -> GenerateRequest:
        """The request as (re)submitted under its current epoch; `kv_source`: where its prompt's
        KV lies (P/D handoff)."""
        request = self.request
        if self.epoch > 0:
            # Once tokenized, a resubmission skips re-tokenizing (and cannot tokenize
            # differently); a client's KV source only at first: after a failure, the KV is
            # computed here.
            changes: dict[str, Any] = {"kv_source": kv_source}
            if request.prompt_token_ids is not None:
                changes |= {"messages": None, "chat": None}
            request = msgspec.structs.replace(request, **changes)
        elif kv_source is not None:
            request = msgspec.structs.replace(request, kv_source=kv_source)
        resume = None
        if self.epoch > 0:
            resume = [sample.resume() for sample in self.samples if not sample.finished]
        return GenerateRequest(request, self.epoch, self.seed, resume)
