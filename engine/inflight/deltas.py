"""Joining what the detokenizer delivered for one request into the outputs its client reads."""

from __future__ import annotations

import time

from engine.inflight.records import RequestRecord
from engine.messages.kv_transfer import KvSource
from engine.messages.outputs import SampleDeltaText
from engine.messages.vectors import float32_values
from engine.request.outputs import CompletionOutput


def join_deltas(
    record: RequestRecord, deltas: list[SampleDeltaText]
) -> tuple[dict[int, CompletionOutput], KvSource | None]:
    """Apply `deltas` to `record`'s samples (and its first token's time); one CompletionOutput
    per sample that moved (by index), and the P/D handoff among them, if any. Deltas of several
    steps that arrive together (a busy root reads several frames at once) are joined into one
    output per sample, as a reader expects of one RequestOutput."""
    outputs: dict[int, CompletionOutput] = {}
    handoff = None
    for delta in deltas:
        sample = record.samples[delta.index]
        if sample.finished:
            continue
        sample.token_ids.extend(delta.token_ids)
        sample.text_parts.append(delta.text)
        sample.finish_reason = delta.finish_reason
        output = outputs.get(delta.index)
        if output is None:
            outputs[delta.index] = CompletionOutput(
                delta.index,
                delta.text,
                list(delta.token_ids),
                delta.finish_reason,
                None if delta.logprobs is None else list(delta.logprobs),
                delta.stop_reason,
            )
        else:
            output.text += delta.text
            output.token_ids.extend(delta.token_ids)
            output.finish_reason = delta.finish_reason
            output.stop_reason = delta.stop_reason
            if delta.logprobs is not None:
                output.logprobs = (output.logprobs or []) + list(delta.logprobs)
        if delta.embedding is not None:
            outputs[delta.index].embedding = float32_values(delta.embedding)
        if record.first is None:
            record.first = delta.first
        if record.prompt_logprobs is None and delta.prompt_logprobs is not None:
            record.prompt_logprobs = [None, *delta.prompt_logprobs]
        handoff = delta.handoff or handoff
    if outputs and record.first_token_at is None:
        record.first_token_at = time.monotonic()
    return outputs, handoff
