"""Sampling rows that keep only their top-k tokens (llama.cpp's default top_k 40), on those k
candidates alone.

A row's distribution after temperature, min_p, top_k and top_p (final_logits' order) has at
most k tokens, all among its k largest logits: min_p keeps a token whose probability is at
least min_p times the largest, that is whose scaled logit is within log(min_p) of the largest;
top_p then works on the probabilities renormalized over what top_k kept. Each rule needs only
the candidates, so the draw is done on [rows, k] instead of [rows, vocabulary]: the vocabulary
is read once, by topk. The draw is Gumbel-max over the candidates, with each candidate's noise
the hash of (seed, position, token id) as in randomness.py: a pure function of the sequence,
whatever the batch.
"""

from __future__ import annotations

import math

import torch

from engine.messages.params import SamplingParams
from engine.model.sampling.randomness import uniform_noise

# Rows that keep at most this many tokens take this path; wider ones sample the vocabulary.
MAX_CANDIDATES = 256
_SALT = 3  # noise of its own, apart from the two-level draw's (salts 0 and 1)


def takes_top_k_draw(params: list[SamplingParams], vocab_size: int) -> bool:
    return all(0 < p.top_k <= MAX_CANDIDATES and p.top_k < vocab_size for p in params)


def top_k_draw(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]
) -> torch.Tensor:
    """One token per row of `logits` ([rows, vocabulary], penalties applied), each from its
    row's final distribution (temperature, min_p, top_k, top_p)."""
    device = logits.device
    width = max(p.top_k for p in params)
    values, order = logits.topk(width, dim=-1)  # each row's candidates, largest first

    def column(name: str) -> torch.Tensor:
        return torch.tensor([float(getattr(p, name)) for p in params], device=device)[:, None]

    scaled = values / column("temperature")
    keep = torch.arange(width, device=device)[None, :] < column("top_k")
    floor = torch.log(column("min_p").clamp(min=1e-38))  # min_p 0: no floor
    keep &= (scaled - scaled[:, :1] >= floor) | (column("min_p") <= 0.0)
    probs = torch.softmax(scaled.masked_fill(~keep, -math.inf), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # probability mass ranked strictly above
    keep &= before < column("top_p")
    keep[:, 0] = True  # the most likely token always stays
    noise = -torch.log(-torch.log(uniform_noise(seeds, positions, order, salt=_SALT)))
    picked = (scaled.masked_fill(~keep, -math.inf) + noise).argmax(dim=-1, keepdim=True)
    return order.gather(1, picked).squeeze(1)
