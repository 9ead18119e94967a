"""Channel scheduler <-> worker ranks: one StepPlan (broadcast) and one StepResult per step.

The plan carries what the ranks do not know yet, and nothing that grows with a request's input
more than once: a request's prompt and sampling parameters arrive once in `new_requests`
(whatever its number of samples); a sequence arrives once in `new_seqs`, naming its request by
key, with the tokens generated so far (so a resumed sequence samples exactly as it would have);
afterwards a sequence is named only by its integer id, and each chunk carries only the KV blocks
appended to its table since its previous chunk, and of its tokens only those past the prompt
(the ranks have the prompt: a prefill chunk says how many of its tokens to take from it). The
ranks keep the rest (engine/model/step_inputs.py) until the plan says to forget it.
"""

from __future__ import annotations

import msgspec

from engine.messages.codec import Channel
from engine.messages.params import SamplingParams


class NewRequest(msgspec.Struct, array_like=True):
    """A request the workers meet for the first time (or again after they restarted)."""

    request_key: int
    prompt_token_ids: list[int]
    params: SamplingParams  # the workers' part: stop strings are the detokenizer's, never sent


class NewSeq(msgspec.Struct, array_like=True):
    """A sequence the workers meet for the first time (or again after preemption / restart)."""

    seq_id: int
    request_key: int
    output_token_ids: list[int]  # tokens generated before (resumed sequences); sampling history
    seed: int  # effective seed; token randomness is a function of (seed, position)


class PlannedChunk(msgspec.Struct, array_like=True):
    """Tokens of one sequence to run through the model this step: the prompt's
    [start_pos, start_pos + prompt_tokens), then `token_ids`."""

    seq_id: int
    # The chunk's tokens past the prompt: the one decode token, or generated tokens recomputed
    # after a preemption. The prompt's own are never sent twice (NewRequest has them).
    token_ids: list[int]
    start_pos: int  # position of the chunk's first token: those before it are in the KV cache
    # Blocks appended to the sequence's block table since its previous chunk; the whole table
    # in its first chunk after an announcement (a NewSeq starts the table afresh).
    new_block_ids: list[int]
    sample: bool  # True when this chunk reaches the sequence's end: sample one token after it
    prompt_tokens: int = 0  # how many of the chunk's tokens, from start_pos on, are the prompt's
    # Speculative decoding: the last `num_proposed` of token_ids are proposed tokens, to be
    # verified (engine/model/speculation/verify.py); the result may then name the sequence
    # repeatedly.
    num_proposed: int = 0
    # Speculative decoding with a draft model: rank 0's draft proposes this many tokens after
    # the chunk (engine/model/speculation/drafter.py); its blocks are reserved.
    num_draft: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + len(self.token_ids)


class StepPlan(msgspec.Struct, tag=True, array_like=True):
    step_id: int
    new_requests: list[NewRequest]
    new_seqs: list[NewSeq]
    chunks: list[PlannedChunk]
    finished_seq_ids: list[int]  # workers drop these sequences' sampling state and tables
    finished_request_keys: list[int]  # ... and these requests (after their sequences)


class SampledLogprobs(msgspec.Struct, array_like=True):
    """Rank 0's logprobs for one sampled token, by token id (the detokenizer turns them into
    the client's TokenLogprob entries, with text)."""

    logprob: float  # of the sampled token
    top_token_ids: list[int]
    top_logprobs: list[float]


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of a sequence's prompt tokens at positions [first_position, first_position +
    len(entries)), each given the tokens before it (vLLM's prompt_logprobs)."""

    seq_id: int
    first_position: int
    entries: list[SampledLogprobs]


class PooledVector(msgspec.Struct, array_like=True):
    """An embedding request's answer: its prompt's pooled hidden state, little-endian float32
    (four bytes a value; msgpack writes a float as nine)."""

    seq_id: int
    values: bytes


class StepResult(msgspec.Struct, tag=True, array_like=True):
    step_id: int
    # One entry per token sampled, in plan order: one per chunk with sample=True, and one
    # more per accepted proposal (a sequence's entries are consecutive).
    seq_ids: list[int]
    token_ids: list[int]
    logprobs: list[SampledLogprobs] | None = None  # present when any sequence asked for logprobs
    prompt_logprobs: list[PromptLogprobs] | None = None  # chunks of sequences that asked
    # When rank 0 took the plan in and when its result was ready (time.monotonic(), one clock
    # for every process of the machine): the scheduler measures the steps and the gaps between
    # them with these (StepTimes).
    started_at: float = 0.0
    finished_at: float = 0.0
    embeddings: list[PooledVector] | None = None  # sequences of embedding requests that ended


class WorkerFailed(msgspec.Struct, tag=True, array_like=True):
    """Rank 0 could not compute these sequences of a step (they failed even when run alone):
    the scheduler fails their requests with `status`, 500, or 400 for a request's own fault (a
    constraint the grammar library stopped on). The step's StepResult follows, with the
    sequences that were computed; a plan without chunks gets no StepResult, as always."""

    step_id: int
    seq_ids: list[int]
    error: str
    status: int = 500


STEP_PLANS: Channel[StepPlan] = Channel("step-plan", StepPlan)
STEP_RESULTS: Channel[StepResult | WorkerFailed] = Channel("step-result", StepResult | WorkerFailed)
