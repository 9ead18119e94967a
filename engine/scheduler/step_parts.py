"""What the scheduler puts into a plan and takes out of a result for one sequence."""

from __future__ import annotations

from engine.messages.kv_transfer import KvSource
from engine.messages.scheduling import FirstScheduled, SampleDelta
from engine.messages.steps import PlannedChunk, SampledLogprobs, StepResult
from engine.scheduler.policy import ScheduledChunk
from engine.scheduler.requests import Request, SequenceState
from engine.scheduler.speculation import Proposal


def planned_chunk(chunk: ScheduledChunk, proposed: Proposal) -> PlannedChunk:
    """A chunk as the ranks get it (`proposed`: tokens to verify after it, or to draft); the
    blocks it names count as sent."""
    seq = chunk.seq
    end = chunk.start + chunk.num_tokens
    block_ids = seq.block_table.block_ids
    # The ranks have the prompt (NewRequest): its tokens are named, not sent again.
    from_prompt = max(min(end, seq.num_prompt_tokens) - chunk.start, 0)
    planned = PlannedChunk(
        seq.seq_id,
        seq.token_ids[chunk.start + from_prompt : end] + proposed.tokens,
        chunk.start,
        block_ids[seq.blocks_sent :],
        end == seq.num_tokens,  # it reaches the sequence's end: sample
        from_prompt,
        len(proposed.tokens),
        proposed.num_draft,
    )
    seq.blocks_sent = len(block_ids)
    return planned


def pooled(result: StepResult, seq_id: int) -> bytes | None:
    """An embedding request's vector, from the step that ended its prompt."""
    return next((v.values for v in result.embeddings or () if v.seq_id == seq_id), None)


def first_report(request: Request, now: float) -> FirstScheduled | None:
    """The request's first-scheduled figures (cache hits, queue and prefill time), once."""
    if request.first_reported or request.first_scheduled is None:
        return None
    request.first_reported = True
    return FirstScheduled(
        request.num_cached_tokens,
        request.first_scheduled - request.arrival,
        now - request.first_scheduled,
    )


def sample_delta(
    seq: SequenceState,
    result: StepResult,
    position: int,
    logprobs: list[SampledLogprobs] | None,
    reason: str | None,
    handoff: KvSource | None,
    now: float,
) -> SampleDelta:
    """The sample's news from the token at `position` of `result` (already in its token_ids)."""
    wants_logprobs = logprobs is not None and seq.params.logprobs is not None
    return SampleDelta(
        seq.request.request_id,
        seq.request.epoch,
        seq.index,
        [result.token_ids[position]],
        [logprobs[position]] if wants_logprobs and logprobs is not None else None,
        reason,
        first_report(seq.request, now),
        seq.request.take_prompt_scores(),
        handoff,
        pooled(result, seq.seq_id),
    )
