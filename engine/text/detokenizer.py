"""The detokenizer's domain object: scheduler outputs in, text for the gateway out.

It learns each request (the prompt's last tokens, stop strings, resume points) from the
TextStart the scheduler sends ahead of any of its tokens (`text_start` says what goes in one),
keeps one SampleTextStream per unfinished sample, and drops whatever belongs to an older epoch.
A sample that hits a stop string is finished here; `stops` tells the scheduler to stop
generating it. A request whose text cannot be made (an exception while handling it) fails alone
with status 500 and `aborts` names it for the scheduler; the other requests go on. Torch-free,
no I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, NamedTuple

from engine.messages.failures import RequestFailed
from engine.messages.outputs import (
    OutputBatch,
    SampleDeltaText,
    SampleLogprobs,
    TextStarted,
    TokenLogprob,
)
from engine.messages.scheduling import (
    AbortRequests,
    FromScheduler,
    SampleDelta,
    StopSamples,
    SubmitRequest,
    TextParams,
    TextStart,
    TokenBatch,
)
from engine.messages.steps import SampledLogprobs
from engine.text.incremental import PROMPT_CONTEXT_TOKENS, as_decoder
from engine.text.stream import SampleTextStream

log = logging.getLogger(__name__)


class DetokenizerOutput(NamedTuple):
    batch: OutputBatch | None  # for the gateway; None when there is nothing to say
    stops: list[StopSamples]  # for the scheduler: samples ended by a stop string
    aborts: tuple[str, ...] = ()  # for the scheduler: requests that failed here


def text_start(submit: SubmitRequest) -> TextStart:
    """What the detokenizer needs of a request the scheduler took in: the whole prompt only
    when prompt logprobs name its tokens."""
    wanted = submit.params.prompt_logprobs is not None
    return TextStart(
        request_id=submit.request_id,
        epoch=submit.epoch,
        num_samples=submit.params.n,
        params=TextParams.of(submit.params),
        context_token_ids=submit.prompt_token_ids[-PROMPT_CONTEXT_TOKENS:],
        resume=submit.resume,
        prompt_token_ids=submit.prompt_token_ids if wanted else None,
        prompt_logprobs=wanted,
    )


class _RequestText:
    __slots__ = ("epoch", "prompt_token_ids", "streams")

    def __init__(
        self, epoch: int, prompt_token_ids: list[int] | None, streams: dict[int, SampleTextStream]
    ) -> None:
        self.epoch = epoch
        self.prompt_token_ids = prompt_token_ids  # names the tokens of prompt logprobs
        self.streams = streams


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._decoder = as_decoder(tokenizer)
        self._requests: dict[str, _RequestText] = {}
        self._token_texts: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def handle(self, messages: Iterable[FromScheduler]) -> DetokenizerOutput:
        started: list[TextStarted] = []
        samples: list[SampleDeltaText] = []
        failures: list[RequestFailed] = []
        stops: list[StopSamples] = []
        aborts: list[str] = []
        for message in messages:
            if isinstance(message, TokenBatch):
                for item in message.items:
                    try:
                        self._on_delta(item, samples, stops)
                    except Exception as exc:
                        failures.append(self._fail(item.request_id, item.epoch, exc))
                        aborts.append(item.request_id)
            elif isinstance(message, TextStart):
                try:
                    started.append(self.start(message))
                except Exception as exc:
                    failures.append(self._fail(message.request_id, message.epoch, exc))
                    aborts.append(message.request_id)
            elif isinstance(message, AbortRequests):
                self.abort(message.request_ids)
            elif isinstance(message, RequestFailed):
                failures.append(self.forget_failed(message))
        batch = OutputBatch(started, samples, failures) if started or samples or failures else None
        return DetokenizerOutput(batch, stops, tuple(aborts))

    def start(self, start: TextStart) -> TextStarted:
        """Start (or, for a newer epoch, restart) a request's streams, primed when resumed;
        the gateway's acknowledgement."""
        current = self._requests.get(start.request_id)
        if current is None or start.epoch > current.epoch:
            starts: dict[int, list[int]]
            if start.resume is None:
                starts = {index: [] for index in range(start.num_samples)}
            else:
                starts = {item.index: item.delivered_token_ids for item in start.resume}
            streams = {
                index: SampleTextStream(
                    self._tokenizer, start.context_token_ids, start.params, delivered
                )
                for index, delivered in starts.items()
            }
            named = start.prompt_token_ids  # only with prompt logprobs
            self._requests[start.request_id] = _RequestText(start.epoch, named, streams)
        return TextStarted(start.request_id, start.epoch)

    def abort(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._requests.pop(request_id, None)

    def forget_failed(self, failure: RequestFailed) -> RequestFailed:
        """Another actor failed this request: drop its streams (of that epoch or an older one:
        a failed resubmission ends the request), pass it on."""
        current = self._requests.get(failure.request_id)
        if current is not None and current.epoch <= failure.epoch:
            del self._requests[failure.request_id]
        return failure

    def _fail(self, request_id: str, epoch: int, exc: Exception) -> RequestFailed:
        log.exception("could not make the text of request %s", request_id)
        self._requests.pop(request_id, None)
        message = f"could not make this request's text: {type(exc).__name__}: {exc}"
        return RequestFailed(
            request_id=request_id, epoch=epoch, status=500, message=message, actor="detokenizer"
        )

    def token_text(self, token_id: int) -> str:
        """One token's own text, as logprobs show it (special tokens included)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._decoder.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    def _on_delta(
        self, item: SampleDelta, samples: list[SampleDeltaText], stops: list[StopSamples]
    ) -> None:
        request = self._requests.get(item.request_id)
        if request is None or request.epoch != item.epoch:
            return  # aborted, or an older epoch's late tokens
        stream = request.streams.get(item.index)
        if stream is None:
            return  # already ended by a stop string; the scheduler will stop it shortly
        text = stream.push(item.new_token_ids, item.finish_reason)
        finish_reason = stream.finish_reason
        logprobs = None
        if item.logprobs is not None:
            pairs = zip(item.logprobs, item.new_token_ids, strict=False)
            logprobs = [self._logprobs(entry, token_id) for entry, token_id in pairs]
        prompt_logprobs = None
        if item.prompt_logprobs is not None and request.prompt_token_ids is not None:
            pairs = zip(item.prompt_logprobs, request.prompt_token_ids[1:], strict=False)
            prompt_logprobs = [self._logprobs(entry, token_id) for entry, token_id in pairs]
        samples.append(
            SampleDeltaText(
                item.request_id,
                item.epoch,
                item.index,
                item.new_token_ids,
                text,
                logprobs,
                finish_reason,
                stream.stop_reason,
                item.first,
                prompt_logprobs,
                # A stop string that ended the sample here makes a handoff to continue moot (a
                # hold, made whatever the first token, comes with the scheduler's finish).
                item.handoff if finish_reason is None or item.finish_reason is not None else None,
                item.embedding,
            )
        )
        if finish_reason is None and item.handoff is None:
            return
        if finish_reason is not None and item.finish_reason is None:  # ended by a stop string
            stops.append(StopSamples(item.request_id, item.epoch, [item.index]))
        del request.streams[item.index]
        if not request.streams:
            del self._requests[item.request_id]

    def _logprobs(self, logprobs: SampledLogprobs, token_id: int) -> SampleLogprobs:
        top = [
            TokenLogprob(top_id, self.token_text(top_id), value)
            for top_id, value in zip(logprobs.top_token_ids, logprobs.top_logprobs, strict=True)
        ]
        return SampleLogprobs(token_id, self.token_text(token_id), logprobs.logprob, top)
