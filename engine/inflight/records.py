"""What the gateway keeps of each unfinished request: the truth a resubmission is built from."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.inflight.output_stream import OutputStream
from engine.messages.admin import RequestRow
from engine.messages.kv_transfer import KvHandoff, KvSource
from engine.messages.outputs import SampleDeltaText, SampleLogprobs
from engine.messages.params import SamplingParams
from engine.messages.requests import ChatMessage, ChatOptions, GenerateRequest
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
    request_id: str
    params: SamplingParams
    seed: int
    prompt: str | None
    prompt_token_ids: list[int] | None
    messages: list[ChatMessage] | None
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
    chat: ChatOptions | None = None  # how to render `messages`
    first: FirstScheduled | None = None  # the scheduler's first report (cache hits, times)
    # When asked for, once computed: None for the first prompt token (as vLLM), then each one's.
    prompt_logprobs: list[SampleLogprobs | None] | None = None
    # P/D across instances: "hold" (a prefill instance keeps the prompt's KV for a decode
    # instance) and the source a decode instance pulls from at first submission; the
    # kv_transfer_params a prefill instance answers with once it holds the KV.
    kv_handoff: KvHandoff = ""
    kv_source: KvSource | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # For its trace span (engine/telemetry/): the W3C trace context it came with, when it was
    # resubmitted after restarts (monotonic), and why it failed if it did.
    trace_headers: Mapping[str, str] | None = None
    resubmitted_at: list[float] = field(default_factory=list)
    failure: str | None = None

    def output(self, outputs: list[CompletionOutput], finished: bool) -> RequestOutput:
        """What its stream gets next: `outputs`, with what is known of the whole request."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
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
            chat=self.chat if self.prompt_token_ids is None else None,
            kv_handoff=self.kv_handoff,
            # A client's source only at first: after a failure, the KV is computed here.
            kv_source=kv_source or (self.kv_source if self.epoch == 0 else None),
        )
