"""Verifying proposed tokens on worker rank 0: every position of a speculative chunk is sampled
as if the proposals before it had been generated, and the proposals stand while they equal
what the target sampled.

A chunk with k proposals has k + 1 logit rows: row d is the distribution after the decode token
and proposals 1..d. Depth by depth, each sequence still accepting samples its row d with the
ordinary sampler (penalties, grammars, min_tokens, logprobs: all as without speculation, the
history holding exactly the tokens accepted so far), and stops at the first sampled token that
differs from its proposal, or after its last proposal (the bonus token).

Why this keeps the target distribution: sampling is a pure function of (seed, position,
logits) (engine/model/sampling/sampler.py), so the token sampled at a position is the token the
non-speculative step would have sampled there, given the same history. Accepting a proposal
only when it equals that token gives the non-speculative output itself, token for token, with
or without a seed. For a proposal drawn from a point mass (n-gram lookup) this is rejection
sampling: the proposal is accepted with probability p_target(proposal) = min(1, p/q) for q = 1,
and on rejection the token comes from p_target with the proposal's mass removed, renormalised
(`residual_distribution` states that form; the unit test checks the two agree).
A rejected proposal never reaches the sampler's history, so a grammar never sees it.

A draft model's proposal of a sampled request is verified the same way by default: the draft
drew it from its distribution q with the noise of the target's own draw at that position
(engine/model/speculation/drafter.py), a Gumbel coupling, so it stands where both models draw the
same token: accepted at most sum(min(p, q)) of the time, always where p = q (independent draws
would agree sum(p * q) of the time). The output is then the non-speculative output whatever
was drafted; since a restart changes which positions are drafted, that is what makes a resumed
stream continue exactly as the undisturbed one.

With `"acceptance_method": "rejection_sampler"` (`draft_probs` given) it is vLLM's rejection
sampling instead: x is accepted with probability min(1, p(x) / q(x)), and on rejection the token
is drawn from max(0, p - q) renormalised, which leaves the output distributed as p whatever q
is and accepts sum(min(p, q)) of the time, the most any rule keeping p can; but the token at a
drafted position is then a function of x, q and the noise, not of the noise alone, so it is the
same distribution and not the same draws as without speculation. The uniform and the residual
draw are functions of (seed, position) too, with noise of their own. A rejection never draws x
(its residual mass is 0), so "the token equals the proposal" still means accepted. Greedy rows
(and every row without q) accept exactly the target's own token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from engine.messages.steps import SampledLogprobs
from engine.model.sampling.randomness import gumbel_argmax, uniform_noise
from engine.model.sampling.sampler import RandomDraw, Sampler
from engine.model.step_inputs import SeqChunk

_NO_LOGPROBS = SampledLogprobs(0.0, [], [])  # rows of sequences that did not ask are never read


_ACCEPT_SALT = 4  # the acceptance uniform's noise (uniform_noise salt)
_RESIDUAL_SALT = 3  # the residual draw's (gumbel_argmax salt: uniform salts 6 and 7)


def verify_proposals(
    sampler: Sampler,
    chunks: Sequence[SeqChunk],
    logits: torch.Tensor,
    draft_probs: Mapping[int, torch.Tensor] | None = None,
) -> tuple[list[int], list[int], list[SampledLogprobs] | None]:
    """Tokens for sampled `chunks` whose logits hold 1 + num_proposed rows each, in order;
    `draft_probs`: by sequence id, the draft's distributions [num_proposed, vocab] its
    proposals were drawn from (absent: proposals to accept only where the target drew them).

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
        draw = _rejection(chunks, accepting, depth, draft_probs) if draft_probs else None
        sampled, scores = sampler.sample([chunks[i].seq_id for i in accepting], logits[rows], draw)
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


def _rejection(
    chunks: Sequence[SeqChunk],
    accepting: list[int],
    depth: int,
    draft_probs: Mapping[int, torch.Tensor],
) -> RandomDraw:
    """The random rows' draw at `depth`: rejection sampling against q where a draft has q."""

    def draw(
        final: torch.Tensor, rows: list[int], seeds: list[int], positions: list[int]
    ) -> torch.Tensor:
        chosen = gumbel_argmax(final, seeds, positions)  # the bonus token, or no draft
        drafted = []
        for offset, row in enumerate(rows):
            chunk = chunks[accepting[row]]
            if depth < chunk.num_proposed and chunk.seq_id in draft_probs:
                drafted.append(offset)
        if not drafted:
            return chosen
        index = torch.tensor(drafted, device=final.device)
        p = torch.softmax(final[index].float(), dim=-1)
        q = torch.stack([draft_probs[chunks[accepting[rows[o]]].seq_id][depth] for o in drafted])
        q = q.to(device=p.device, dtype=p.dtype)[:, : p.shape[1]]
        proposed = torch.tensor(
            [_proposal(chunks[accepting[rows[o]]], depth) for o in drafted], device=p.device
        )
        sub_seeds = [seeds[o] for o in drafted]
        sub_positions = [positions[o] for o in drafted]
        p_x = p.gather(1, proposed.unsqueeze(1)).squeeze(1)
        q_x = q.gather(1, proposed.unsqueeze(1)).squeeze(1)
        zeros = torch.zeros(len(drafted), 1, dtype=torch.long, device=p.device)
        uniform = uniform_noise(sub_seeds, sub_positions, zeros, salt=_ACCEPT_SALT).squeeze(1)
        accept = uniform * q_x < p_x  # u < p(x) / q(x), without dividing by a zero q(x)
        residual = (p - q).clamp(min=0.0)
        empty = residual.sum(dim=1, keepdim=True) <= 0.0  # p <= q everywhere: p == q
        residual = torch.where(empty, p, residual)
        redrawn = gumbel_argmax(residual.log(), sub_seeds, sub_positions, _RESIDUAL_SALT)
        chosen[index] = torch.where(accept, proposed, redrawn.to(proposed.dtype)).to(chosen.dtype)
        return chosen

    return draw


def _proposal(chunk: SeqChunk, depth: int) -> int:
    """The chunk's proposal at `depth` (its tokens end with its proposals)."""
    return chunk.token_ids[len(chunk.token_ids) - chunk.num_proposed + depth]


def residual_distribution(probs: torch.Tensor, rejected: int) -> torch.Tensor:
    """The target distribution with a rejected point-mass proposal's mass removed,
    renormalised: what rejection sampling draws from after rejecting `rejected`."""
    residual = probs.clone()
    residual[rejected] = 0.0
    return residual / residual.sum()
