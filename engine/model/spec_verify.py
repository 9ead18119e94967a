"""Verifying proposed tokens on worker rank 0: every position of a speculative chunk is sampled
as if the proposals before it had been generated, and the proposals stand while they equal
what the target sampled.

A chunk with k proposals has k + 1 logit rows: row d is the distribution after the decode token
and proposals 1..d. Depth by depth, each sequence still accepting samples its row d with the
ordinary sampler (penalties, grammars, min_tokens, logprobs: all as without speculation, the
history holding exactly the tokens accepted so far), and stops at the first sampled token that
differs from its proposal, or after its last proposal (the bonus token).

Why this keeps the target distribution: sampling is a pure function of (seed, position,
logits) (engine/model/sampler.py), so the token sampled at a position is the token the
non-speculative step would have sampled there, given the same history. Accepting a proposal
only when it equals that token gives the non-speculative output itself, token for token, with
or without a seed. For a proposal drawn from a point mass (n-gram lookup) this is rejection
sampling: the proposal is accepted with probability p_target(proposal) = min(1, p/q) for q = 1,
and on rejection the token comes from p_target with the proposal's mass removed, renormalised
(`residual_distribution` states that form; the unit test checks the two agree).
A rejected proposal never reaches the sampler's history, so a grammar never sees it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.messages.steps import SampledLogprobs
from engine.model.sampler import Sampler
from engine.model.step_inputs import SeqChunk

_NO_LOGPROBS = SampledLogprobs(0.0, [], [])  # rows of sequences that did not ask are never read


def verify_proposals(
    sampler: Sampler, chunks: Sequence[SeqChunk], logits: torch.Tensor
) -> tuple[list[int], list[int], list[SampledLogprobs] | None]:
    """Tokens for sampled `chunks` whose logits hold 1 + num_proposed rows each, in order.

    Returns (seq_ids, token_ids, logprobs): each sequence's accepted proposals and its own
    final token, consecutive, in the chunks' order; a sequence id repeats once per token."""
    first_rows: list[int] = []
    row = 0
    for chunk in chunks:
        first_rows.append(row)
        row += 1 + chunk.num_proposed
    if row != logits.shape[0]:
        raise ValueError(f"verify_proposals: {logits.shape[0]} logit rows for {row} positions")
    tokens: list[list[int]] = [[] for _ in chunks]
    logprobs: list[list[SampledLogprobs]] = [[] for _ in chunks]
    any_logprobs = False
    accepting = list(range(len(chunks)))
    depth = 0
    while accepting:
        rows = torch.tensor([first_rows[i] + depth for i in accepting], device=logits.device)
        sampled, scores = sampler.sample([chunks[i].seq_id for i in accepting], logits[rows])
        any_logprobs = any_logprobs or scores is not None
        still: list[int] = []
        for offset, index in enumerate(accepting):
            tokens[index].append(sampled[offset])
            logprobs[index].append(_NO_LOGPROBS if scores is None else scores[offset])
            if depth < chunks[index].num_proposed and sampled[offset] == _proposal(
                chunks[index], depth
            ):
                still.append(index)
        accepting = still
        depth += 1
    seq_ids = [chunk.seq_id for chunk, own in zip(chunks, tokens, strict=True) for _ in own]
    flat_tokens = [token for own in tokens for token in own]
    flat_logprobs = [entry for own in logprobs for entry in own] if any_logprobs else None
    return seq_ids, flat_tokens, flat_logprobs


def _proposal(chunk: SeqChunk, depth: int) -> int:
    """The chunk's proposal at `depth` (its tokens end with its proposals)."""
    return chunk.token_ids[len(chunk.token_ids) - chunk.num_proposed + depth]


def residual_distribution(probs: torch.Tensor, rejected: int) -> torch.Tensor:
    """The target distribution with a rejected point-mass proposal's mass removed,
    renormalised: what rejection sampling draws from after rejecting `rejected`."""
    residual = probs.clone()
    residual[rejected] = 0.0
    return residual / residual.sum()
