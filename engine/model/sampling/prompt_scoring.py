"""Prompt logprobs (vLLM's `prompt_logprobs`, what scoring with `echo` reads): each prompt token's
logprob given the tokens before it, with the top alternatives.

They come from the prefill: a sequence that asks has logits computed for every token of its
prompt chunks (ModelRunner.prepare's `every_row`), not only the sampled last one; the row of
position p scores prompt token p + 1. A sequence resumed with tokens already generated has had
its prompt logprobs delivered (with its first token): it is not scored again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from engine.messages.steps import PromptLogprobs, SampledLogprobs
from engine.model.step_inputs import SeqChunk, SequenceStart


class PromptScoring:
    """The sequences of this rank whose prompts are scored (every rank keeps the same set: it
    decides which logit rows the step computes)."""

    def __init__(self) -> None:
        self._prompts: dict[int, tuple[list[int], int]] = {}  # seq_id -> (prompt, top count)

    def watch(self, new_seq: SequenceStart) -> None:
        top = new_seq.params.prompt_logprobs
        if top is not None and not new_seq.output_token_ids:
            self._prompts[new_seq.seq_id] = (new_seq.prompt_token_ids, top)

    def forget(self, seq_ids: Iterable[int]) -> None:
        if self._prompts:
            for seq_id in seq_ids:
                self._prompts.pop(seq_id, None)

    def reset(self) -> None:
        self._prompts.clear()

    def every_row(self, chunks: Sequence[SeqChunk]) -> set[int]:
        """Sequences among `chunks` whose chunk holds prompt tokens that score a later one."""
        if not self._prompts:
            return set()
        return {
            chunk.seq_id
            for chunk in chunks
            if chunk.seq_id in self._prompts
            and chunk.start_pos < len(self._prompts[chunk.seq_id][0]) - 1
        }

    def split(
        self, chunks: Sequence[SeqChunk], every_row: set[int], logits: torch.Tensor
    ) -> tuple[torch.Tensor, list[PromptLogprobs]]:
        """From a step's logits (rows as ModelRunner.prepare listed them): the rows to sample
        (one per chunk with sample=True, and one per proposal, in plan order) and the prompt
        logprobs."""
        if not every_row:
            return logits, []
        sampled: list[int] = []
        scored: list[PromptLogprobs] = []
        row = 0
        for chunk in chunks:
            if chunk.seq_id not in every_row:
                if chunk.sample:  # its last token's row and one per proposal
                    rows = 1 + chunk.num_proposed
                    sampled += range(row, row + rows)
                    row += rows
                continue
            count = len(chunk.token_ids)
            prompt, top = self._prompts[chunk.seq_id]
            # Row i is position start + i and scores the prompt token after it, if any.
            targets = prompt[chunk.start_pos + 1 : chunk.start_pos + count + 1]
            scored.append(
                PromptLogprobs(
                    chunk.seq_id,
                    chunk.start_pos + 1,
                    _score(logits[row : row + len(targets)], targets, top),
                )
            )
            if chunk.sample:
                sampled.append(row + count - 1)
            row += count
        return logits[torch.tensor(sampled, dtype=torch.long, device=logits.device)], scored


def _score(logits: torch.Tensor, targets: list[int], top: int) -> list[SampledLogprobs]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(targets, dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
    if top == 0:
        return [SampledLogprobs(value, [], []) for value in chosen]
    best = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)
    best_ids, best_values = best.indices.tolist(), best.values.tolist()
    return [
        SampledLogprobs(value, ids_, values)
        for value, ids_, values in zip(chosen, best_ids, best_values, strict=True)
    ]
