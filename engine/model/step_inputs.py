"""What a worker rank remembers between plans, and the whole inputs it rebuilds from each one.

A StepPlan carries deltas (messages/steps.py): a request's prompt and parameters once, a
sequence once, and for each chunk only the KV blocks appended since its previous chunk.
`KnownSequences` keeps the rest, so that the runner and the sampler still get whole inputs:
`SeqChunk`s with full block tables and `SequenceStart`s with their prompt and parameters.
Plain Python, no torch: the scheduler's tests drive it with a reference worker.
"""

from __future__ import annotations

import msgspec

from engine.messages.params import LoRARequest, SamplingParams
from engine.messages.steps import NewRequest, StepPlan

# Steps computing more tokens than this run off the worker's event loop, so that heartbeats and
# control messages keep flowing during long prefills.
LONG_STEP_TOKENS = 512


def is_long(plan: StepPlan) -> bool:
    return step_tokens(plan) > LONG_STEP_TOKENS


def step_tokens(plan: StepPlan) -> int:
    """The tokens a step runs through the model: its size, for its deadline."""
    return sum(chunk.num_tokens + chunk.num_draft for chunk in plan.chunks)


class SeqChunk(msgspec.Struct, array_like=True):
    """Tokens of one sequence to run through the model, with its whole block table."""

    seq_id: int
    token_ids: list[int]  # the new tokens (a prefill chunk, or the one decode token)
    start_pos: int  # position of token_ids[0]: tokens before it are already in the KV cache
    block_table: list[int]  # physical KV blocks covering start_pos + len(token_ids)
    sample: bool  # True when this chunk reaches the sequence's end: sample one token after it
    num_proposed: int = 0  # the last num_proposed of token_ids are proposals to verify
    lora: LoRARequest | None = None  # the adapter its request runs with; None: the base model


class SequenceStart(msgspec.Struct, array_like=True):
    """A sequence as the sampler meets it: its request's prompt and parameters, its history."""

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    seed: int


class KnownSequences:
    def __init__(self) -> None:
        self.requests: dict[int, NewRequest] = {}
        self.block_tables: dict[int, list[int]] = {}
        self.request_of: dict[int, NewRequest] = {}  # seq id -> its request (for its prompt)

    def apply(self, plan: StepPlan) -> tuple[list[SequenceStart], list[SeqChunk]]:
        """Take in `plan`: the sequences it starts, and its chunks with whole block tables.

        KeyError names a sequence or request the plan uses without having announced it."""
        for seq_id in plan.finished_seq_ids:
            self.block_tables.pop(seq_id, None)
            self.request_of.pop(seq_id, None)
        for key in plan.finished_request_keys:
            self.requests.pop(key, None)
        for request in plan.new_requests:
            self.requests[request.request_key] = request
        starts = []
        for seq in plan.new_seqs:
            request = self._request(seq.request_key, seq.seq_id)
            self.block_tables[seq.seq_id] = []  # announced afresh: its first chunk sends all
            self.request_of[seq.seq_id] = request
            starts.append(
                SequenceStart(
                    seq.seq_id,
                    request.prompt_token_ids,
                    seq.output_token_ids,
                    request.params,
                    seq.seed,
                )
            )
        chunks = []
        for chunk in plan.chunks:
            table = self.block_tables.get(chunk.seq_id)
            if table is None:
                raise KeyError(f"step {plan.step_id}: chunk of unknown sequence {chunk.seq_id}")
            table += chunk.new_block_ids
            token_ids = chunk.token_ids
            if chunk.prompt_tokens:  # named in the prompt, which the plan sent once
                prompt = self.request_of[chunk.seq_id].prompt_token_ids
                start = chunk.start_pos
                token_ids = prompt[start : start + chunk.prompt_tokens] + token_ids
            chunks.append(
                SeqChunk(
                    chunk.seq_id,
                    token_ids,
                    chunk.start_pos,
                    table,
                    chunk.sample,
                    chunk.num_proposed,
                    self.request_of[chunk.seq_id].params.lora_request,
                )
            )
        return starts, chunks

    def _request(self, key: int, seq_id: int) -> NewRequest:
        request = self.requests.get(key)
        if request is None:
            raise KeyError(f"sequence {seq_id} names request {key}, which no plan announced")
        return request
