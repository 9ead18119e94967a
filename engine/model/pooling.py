"""Embeddings (vLLM's pooling runner): an embedding request's prompt is prefilled like any other,
and rank 0 pools its final hidden states (after the final norm) into one vector instead of
answering with a token alone.

LAST takes the last prompt token's hidden state; MEAN averages every prompt position's. A long
prompt is prefilled in several chunks (chunked prefill), so MEAN keeps a running sum per
sequence across its chunks rather than asking the scheduler to plan the prompt in one chunk: a
prompt longer than a step's token budget could then never run, and one-chunk prompts would
hold up the decode steps batched beside them. The scheduler plans such a prompt whole, never
from the prefix cache (as it does prompts whose logprobs are asked for), so every position is
summed; a sequence announced again (preempted, or the workers restarted) starts its sum afresh.

Every rank keeps the same set of sequences (it decides nothing collective), but only rank 0,
which holds the logits, pools: the hidden states it reads are whole on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.messages.params import PoolingParams
from engine.messages.steps import PooledVector
from engine.messages.vectors import float32_bytes
from engine.model.step_inputs import SeqChunk, SequenceStart


@dataclass
class _Pooled:
    params: PoolingParams
    total: torch.Tensor | None = None  # MEAN: float32 sum of the positions seen so far
    count: int = 0


@dataclass(frozen=True)
class PoolingStep:
    """One step's pooling: the token rows whose hidden states it reads (into the step's
    tokens, in plan order), and for each pooled chunk the slice of those rows that is its own."""

    rows: list[int]
    slices: list[tuple[SeqChunk, int, int]]  # (chunk, first row in `rows`, row count)


class Pooling:
    def __init__(self) -> None:
        self._seqs: dict[int, _Pooled] = {}
        self._pending: list[tuple[_Pooled, torch.Tensor, int]] = []  # MEAN sums to keep

    def watch(self, new_seq: SequenceStart) -> None:
        """Start (again) a sequence's pooling, if its request is an embedding request."""
        if new_seq.params.pooling is not None:
            self._seqs[new_seq.seq_id] = _Pooled(new_seq.params.pooling)
        else:
            self._seqs.pop(new_seq.seq_id, None)

    def forget(self, seq_ids: Iterable[int]) -> None:
        if self._seqs:
            for seq_id in seq_ids:
                self._seqs.pop(seq_id, None)

    def reset(self) -> None:
        self._seqs.clear()

    def plan(self, chunks: Sequence[SeqChunk]) -> PoolingStep:
        """Which of the step's token rows are pooled: a LAST sequence's last row when its chunk
        ends the prompt, every row of a MEAN sequence's chunks."""
        rows: list[int] = []
        slices: list[tuple[SeqChunk, int, int]] = []
        offset = 0
        for chunk in chunks:
            state = self._seqs.get(chunk.seq_id)
            count = len(chunk.token_ids)
            if state is not None and state.params.pooling_type == "MEAN":
                slices.append((chunk, len(rows), count))
                rows += range(offset, offset + count)
            elif state is not None and chunk.sample:
                slices.append((chunk, len(rows), 1))
                rows.append(offset + count - 1)
            offset += count
        return PoolingStep(rows, slices)

    def pool(self, step: PoolingStep, hidden: torch.Tensor | None) -> list[PooledVector]:
        """The vectors of the sequences whose prompt ends in this step, from the normed hidden
        states of `step.rows` (in that order). MEAN sums are kept only when the whole step
        succeeds (`commit`), so a step run again is not counted twice."""
        self._pending = []
        if hidden is None or not step.slices:
            return []
        vectors = []
        for chunk, first, count in step.slices:
            state = self._seqs[chunk.seq_id]
            rows = hidden[first : first + count].float()
            if state.params.pooling_type == "MEAN":
                total = rows.sum(dim=0)
                if state.total is not None:
                    total = total + state.total
                if not chunk.sample:
                    self._pending.append((state, total, state.count + count))
                    continue
                vector = total / (state.count + count)
            else:
                vector = rows[0]
            if state.params.normalize:
                vector = torch.nn.functional.normalize(vector, dim=0)
            vectors.append(PooledVector(chunk.seq_id, float32_bytes(vector.tolist())))
        return vectors

    def commit(self) -> None:
        """Keep the running MEAN sums of the step `pool` last read."""
        for state, total, count in self._pending:
            state.total, state.count = total, count
        self._pending = []
