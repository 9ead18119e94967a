"""What the scheduler puts into a plan and takes out of a result for one sequence."""

from __future__ import annotations

import logging

from engine.messages.kv_transfer import KvSource
from engine.messages.scheduling import FirstScheduled, SampleDelta
from engine.messages.steps import PlannedChunk, SampledLogprobs, StepResult
from engine.scheduler.policy import ScheduledChunk
from engine.scheduler.requests import Request, SequenceState
from engine.scheduler.speculation import Proposal

log = logging.getLogger(__name__)


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


def checked_logprobs(result: StepResult) -> list[SampledLogprobs] | None:
    """The result's logprobs, one per sampled token; None (with a warning) if they are not."""
    logprobs = result.logprobs
    if logprobs is not None and len(logprobs) != len(result.seq_ids):
        log.warning(
            "step %d: %d logprobs for %d tokens; dropping them",
            result.step_id,
            len(logprobs),
            len(result.seq_ids),
        )
        return None
    return logprobs


def is_result_of(result: StepResult, step_id: int | None) -> bool:
    """Whether `result` is the step in flight's (`step_id`; a late one is logged and ignored);
    ValueError if it is malformed."""
    if result.step_id != step_id:
        log.warning("ignoring a result for step %d; in flight: %s", result.step_id, step_id)
        return False
    if len(result.token_ids) != len(result.seq_ids):
        raise ValueError(
            f"StepResult {result.step_id} has {len(result.seq_ids)} seq_ids but "
            f"{len(result.token_ids)} token_ids; expected one token per sampled sequence"
        )
    return True
