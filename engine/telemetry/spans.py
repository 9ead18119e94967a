"""What a finished request's span says, computed from the gateway's record (no OpenTelemetry
here, so it is testable and cheap to import).

The root knows when a request arrived, when its first token came back and when it ended; the
scheduler reports, with the first token, how long the request queued and prefilled. The child
spans are placed on the root's clock from these: prefill ends when the root saw the first token
and starts `prefill_s` before it, the queue wait precedes that, and what is left between arrival
and the queue is the tokenizer's hop (tokenizing and the ring hops to the scheduler). So each
child's length is the measured one; only its placement carries the hops' small transit times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.telemetry import attributes as attr

if TYPE_CHECKING:
    from engine.inflight.records import RequestRecord

AttributeValue = str | int | float | list[str]


@dataclass
class RequestSpan:
    """One request's span, in the root's monotonic seconds."""

    start: float
    end: float
    attributes: dict[str, AttributeValue]
    phases: list[tuple[str, float, float]] = field(default_factory=list)  # (name, start, end)
    restarts: list[tuple[float, int]] = field(default_factory=list)  # (when, new epoch)
    error: str | None = None


def request_span(record: RequestRecord, model_name: str, end: float) -> RequestSpan:
    params = record.params
    completion_tokens = sum(len(sample.token_ids) for sample in record.samples)
    attributes: dict[str, AttributeValue] = {
        attr.RESPONSE_MODEL: model_name,
        attr.REQUEST_ID: record.request_id,
        attr.REQUEST_TEMPERATURE: params.temperature,
        attr.REQUEST_TOP_P: params.top_p,
        attr.REQUEST_N: params.n,
        attr.USAGE_NUM_SEQUENCES: params.n,
        attr.USAGE_PROMPT_TOKENS: len(record.prompt_token_ids or []),
        attr.USAGE_COMPLETION_TOKENS: completion_tokens,
        attr.LATENCY_E2E: end - record.arrival,
        attr.RESTARTS: len(record.resubmitted_at),
        attr.RESPONSE_FINISH_REASONS: [s.finish_reason or "error" for s in record.samples],
    }
    if params.max_tokens is not None:
        attributes[attr.REQUEST_MAX_TOKENS] = params.max_tokens
    span = RequestSpan(record.arrival, end, attributes, error=record.failure)
    span.restarts = [(when, epoch) for epoch, when in enumerate(record.resubmitted_at, 1)]
    first_token = record.first_token_at
    if first_token is None:
        return span
    attributes[attr.LATENCY_TIME_TO_FIRST_TOKEN] = first_token - record.arrival
    decode = end - first_token
    attributes[attr.LATENCY_TIME_IN_MODEL_DECODE] = decode
    if completion_tokens > params.n:  # a decode phase beyond each sample's first token
        span.phases.append((attr.DECODE_SPAN, first_token, end))
    first = record.first
    if first is None:
        return span
    attributes[attr.LATENCY_TIME_IN_QUEUE] = first.queue_s
    attributes[attr.LATENCY_TIME_IN_MODEL_PREFILL] = first.prefill_s
    attributes[attr.LATENCY_TIME_IN_MODEL_INFERENCE] = first.prefill_s + decode
    attributes[attr.PROMPT_CACHED_TOKENS] = first.num_cached_tokens
    prefill_start = max(record.arrival, first_token - first.prefill_s)
    queue_start = max(record.arrival, prefill_start - first.queue_s)
    span.phases[:0] = [
        (attr.TOKENIZE_SPAN, record.arrival, queue_start),
        (attr.QUEUE_SPAN, queue_start, prefill_start),
        (attr.PREFILL_SPAN, prefill_start, first_token),
    ]
    return span
