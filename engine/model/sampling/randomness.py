"""Counter-based randomness: uniforms and Gumbel-max draws that are pure functions of
(sequence seed, token position, salt, vocabulary index), with no generator state: batch
composition, preemption, restarts and the device cannot change what a seed draws."""

from __future__ import annotations

import math

import torch

_M32 = 0xFFFFFFFF
_GROUP = 256  # vocabulary entries per group in the two-level Gumbel draw


def _mix32(x: int) -> int:
    """MurmurHash3's 32-bit finalizer on a Python int."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def _mul32_tensor(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for int64 x in [0, 2**32), never overflowing int64."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _M32


def _mix32_tensor(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32_tensor(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32_tensor(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def row_keys(seed: int, position: int) -> tuple[int, int]:
    """Two 32-bit keys naming the random stream of one (seed, position)."""
    spot = _mix32((position & _M32) ^ 0x9E3779B9) ^ _mix32((position >> 32) & _M32)
    first = _mix32((seed & _M32) ^ spot)
    second = _mix32(((seed >> 32) & _M32) ^ _mix32(first ^ 0x632BE5AB))
    return first, second


def uniform_noise(
    seeds: list[int], positions: list[int], columns: torch.Tensor, salt: int = 0
) -> torch.Tensor:
    """float32 uniforms in (0, 1), one per entry of `columns` ([rows, n] or [1, n] int64 in
    [0, 2**32)), each a hash of (seed, position, salt, column) for its row."""
    keys = torch.tensor(
        [
            row_keys(seed, position ^ (salt << 48))
            for seed, position in zip(seeds, positions, strict=True)
        ],
        dtype=torch.long,
        device=columns.device,
    )
    hashed = _mix32_tensor(columns ^ keys[:, :1])
    hashed = _mix32_tensor(hashed ^ keys[:, 1:])
    return ((hashed >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def _gumbel(uniforms: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(uniforms))


def gumbel_argmax(
    logits: torch.Tensor, seeds: list[int], positions: list[int], salt: int = 0
) -> torch.Tensor:
    """One token per row, distributed as softmax(row): Gumbel-max in two levels (`salt` > 0:
    from noise independent of the plain draw's).

    Perturbing every vocabulary entry would hash rows x vocab numbers per step. Instead the
    vocabulary is cut into groups of _GROUP: a group is drawn by Gumbel-max over the groups'
    log-sum-exp masses, then a token within it by Gumbel-max over its logits. P(group) x
    P(token | group) = p(token): exact, with rows x (groups + _GROUP) hashed numbers.
    """
    rows, vocab_size = logits.shape
    device = logits.device
    num_groups = -(-vocab_size // _GROUP)
    padding = num_groups * _GROUP - vocab_size
    if padding:
        logits = torch.nn.functional.pad(logits, (0, padding), value=-math.inf)
    grouped = logits.view(rows, num_groups, _GROUP)
    group_ids = torch.arange(num_groups, dtype=torch.long, device=device).unsqueeze(0)
    group_noise = _gumbel(uniform_noise(seeds, positions, group_ids, salt=2 * salt + 1))
    group = (torch.logsumexp(grouped, dim=-1) + group_noise).argmax(dim=-1)
    inside = grouped[torch.arange(rows, device=device), group]
    token_ids = group.unsqueeze(1) * _GROUP + torch.arange(_GROUP, device=device).unsqueeze(0)
    token_noise = _gumbel(uniform_noise(seeds, positions, token_ids, salt=2 * salt))
    return group * _GROUP + (inside + token_noise).argmax(dim=-1)
