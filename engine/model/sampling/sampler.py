"""Turns a step's logits into tokens, on worker rank 0, one batched pass for all sequences.

Order of operations on each row (as vLLM does it):
  raw logits ──▶ logprobs (log-softmax of the raw logits, when asked for)
             ──▶ allowed_token_ids ──▶ bad_words ──▶ logit_bias (token_controls.py)
             ──▶ repetition / presence / frequency penalties ──▶ min_tokens mask
             ──▶ structured-output grammar bitmask (engine/structured)
             ──▶ greedy: argmax
             ──▶ random: / temperature ──▶ min_p ──▶ top_k ──▶ top_p ──▶ argmax(+ Gumbel noise)

Randomness is a pure function of (sequence seed, token position, vocabulary index): a counter-
based hash gives each logit its own uniform number, turned into Gumbel noise; the argmax of
logits / T + noise is a sample from softmax(logits / T) (in two levels, `gumbel_argmax`; on the
top-k candidates alone, top_k_draw.py). No generator state exists, so batch composition,
preemption, restarts and the device (CPU or GPU: same hash) cannot change what a seed draws.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from engine.kernels import torch_ops
from engine.messages.params import SamplingParams
from engine.messages.steps import SampledLogprobs
from engine.model.sampling.randomness import gumbel_argmax, uniform_noise
from engine.model.sampling.token_controls import (
    TokenControls,
    apply_grammars,
    apply_token_controls,
)
from engine.model.sampling.top_k_draw import takes_top_k_draw, top_k_draw
from engine.model.step_inputs import SequenceStart
from engine.structured.grammars import GrammarService

__all__ = ["RandomDraw", "Sampler", "final_logits", "gumbel_argmax", "is_greedy", "uniform_noise"]

_MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy (as vLLM)


class _SeqState:
    __slots__ = (
        "_prompt_mask",
        "banned_early",
        "controls",
        "has_penalties",
        "is_greedy",
        "output",
        "params",
        "prompt",
        "seed",
    )

    def __init__(
        self,
        new_seq: SequenceStart,
        eos_token_ids: list[int],
        vocab_size: int,
        grammars: GrammarService | None,
    ) -> None:
        params = new_seq.params
        self.params = params
        self.seed = new_seq.seed & ((1 << 64) - 1)
        self.prompt = new_seq.prompt_token_ids
        self.output = list(new_seq.output_token_ids)
        self.is_greedy = params.temperature < _MIN_TEMPERATURE
        self.has_penalties = (
            params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
        )
        # Tokens that may not be sampled before min_tokens are out.
        early = list(params.stop_token_ids)
        if not params.ignore_eos:
            early += eos_token_ids
        self.banned_early = early
        self._prompt_mask: torch.Tensor | None = None  # built on first use
        self.controls: TokenControls | None = None
        if TokenControls.wanted(params):
            self.controls = TokenControls(params, vocab_size, grammars)

    @property
    def position(self) -> int:
        """Position of the token about to be sampled."""
        return len(self.prompt) + len(self.output)

    def prompt_mask(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """[vocab] bool: which tokens occur in the prompt (kept: the prompt never changes)."""
        if self._prompt_mask is None or self._prompt_mask.device != device:
            ids = _padded([self.prompt], vocab_size, device)[0]
            mask = torch.zeros(vocab_size + 1, dtype=torch.bool, device=device)
            mask[ids] = True
            self._prompt_mask = mask[:vocab_size]
        return self._prompt_mask

    def recent_tokens(self, count: int, vocab_size: int) -> list[int]:
        """The distinct vocabulary tokens among the last `count` of prompt + output."""
        tail = self.output[-count:]
        missing = count - len(tail)
        recent = (self.prompt[-missing:] if missing > 0 else []) + tail
        return [token for token in set(recent) if 0 <= token < vocab_size]

    def min_tokens_pending(self) -> bool:
        return len(self.output) < self.params.min_tokens and bool(self.banned_early)


class Sampler:
    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: list[int],
        grammars: GrammarService | None = None,
        argmax_rows: Callable[[torch.Tensor], torch.Tensor] = torch_ops.argmax_rows,
    ) -> None:
        """`argmax_rows`: the greedy pick over logits [rows, vocab], the kernel backend's (the
        cpu backend's is compiled; torch's reduction is slow there)."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be an integer >= 1, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.argmax_rows = argmax_rows
        self.eos_token_ids = list(eos_token_ids)
        self.grammars = grammars  # None: requests with bad_words or structured_outputs fail
        self._seqs: dict[int, _SeqState] = {}

    def add(self, new_seq: SequenceStart) -> None:
        """Start tracking a sequence; a known one (re-announced after preemption) is replaced."""
        self._seqs[new_seq.seq_id] = _SeqState(
            new_seq, self.eos_token_ids, self.vocab_size, self.grammars
        )

    def remove(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._seqs.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._seqs)

    def output_token_ids(self, seq_id: int) -> list[int]:
        return list(self._seqs[seq_id].output)

    def history(self, seq_id: int, start: int) -> list[int]:
        """The sequence's tokens (prompt, then output) from position `start` on."""
        state = self._seqs[seq_id]
        return state.prompt[start:] + state.output[max(start - len(state.prompt), 0) :]

    def params_and_seed(self, seq_id: int) -> tuple[SamplingParams, int]:
        state = self._seqs[seq_id]
        return state.params, state.seed

    def sample(
        self, seq_ids: list[int], logits: torch.Tensor, draw: RandomDraw | None = None
    ) -> tuple[list[int], list[SampledLogprobs] | None]:
        """One token per row of `logits` ([len(seq_ids), >= vocab_size]), recorded in each
        sequence's history; logprobs for every row when any sequence asked for them.

        `draw` picks the random (non-greedy) rows' tokens from their final logits (after
        temperature and truncation) instead of the plain Gumbel-max draw: speculative
        decoding's rejection sampling (engine/model/speculation/verify.py)."""
        states = self._states(seq_ids, logits)
        logits = logits[:, : self.vocab_size]
        want_logprobs = any(state.params.logprobs is not None for state in states)
        controlled = any(state.controls is not None for state in states)
        if (
            not want_logprobs
            and not controlled
            and all(
                state.is_greedy and not state.has_penalties and not state.min_tokens_pending()
                for state in states
            )
        ):
            tokens = self.argmax_rows(logits).tolist()
            self._record(states, tokens)
            return tokens, None

        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        if controlled or any(state.has_penalties or state.min_tokens_pending() for state in states):
            logits = logits.clone()  # edited in place below; the caller's tensor stays intact
            if controlled:
                controls = [state.controls for state in states]
                apply_token_controls(logits, controls, [state.output for state in states])
            _apply_penalties(logits, states, self.vocab_size)
            _apply_min_tokens(logits, states, self.vocab_size)
            if controlled:
                outputs = [state.output for state in states]
                apply_grammars(logits, controls, outputs, self.grammars)
        random_rows = [row for row, state in enumerate(states) if not state.is_greedy]
        if len(random_rows) == len(states):
            chosen = _sample_random(logits, states, random_rows, draw)
        else:
            chosen = self.argmax_rows(logits)
            if random_rows:
                rows = torch.tensor(random_rows, device=logits.device)
                randoms = [states[row] for row in random_rows]
                chosen[rows] = _sample_random(logits[rows], randoms, random_rows, draw)
        tokens = chosen.tolist()
        self._record(states, tokens)
        if raw_logprobs is None:
            return tokens, None
        return tokens, _gather_logprobs(raw_logprobs, chosen, states)

    def _states(self, seq_ids: list[int], logits: torch.Tensor) -> list[_SeqState]:
        if logits.dim() != 2 or logits.shape[0] != len(seq_ids):
            raise ValueError(
                f"logits must have shape [{len(seq_ids)}, >= {self.vocab_size}] (one row per "
                f"seq_id), got {list(logits.shape)}"
            )
        if logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits have {logits.shape[1]} columns, fewer than vocab_size {self.vocab_size}"
            )
        try:
            return [self._seqs[seq_id] for seq_id in seq_ids]
        except KeyError as exc:
            raise ValueError(f"sample() got seq_id {exc.args[0]}, which was never added") from None

    @staticmethod
    def _record(states: list[_SeqState], tokens: list[int]) -> None:
        for state, token in zip(states, tokens, strict=True):
            state.output.append(token)


# ---- logits processing -------------------------------------------------------------------------


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Rows of token ids as one [len(rows), max_len] tensor; ids outside the vocabulary -> pad."""
    width = max(1, max(len(row) for row in rows))
    table = torch.full((len(rows), width), pad, dtype=torch.long)
    for index, row in enumerate(rows):
        if row:
            table[index, : len(row)] = torch.tensor(row, dtype=torch.long)
    table = table.to(device)
    return torch.where((table >= 0) & (table < pad), table, pad)


def _apply_penalties(logits: torch.Tensor, states: list[_SeqState], vocab_size: int) -> None:
    """Repetition over prompt + output (or its last repeat_last_n tokens); presence and
    frequency over the output (vLLM's rules)."""
    with_penalties = [row for row, state in enumerate(states) if state.has_penalties]
    # A windowed repetition penalty alone (llama.cpp's default) touches at most repeat_last_n
    # logits of a row: those are edited in place, not through masks over the vocabulary.
    windowed = [row for row in with_penalties if _window_only(states[row].params)]
    _apply_recent_repetition(logits, [(row, states[row]) for row in windowed], vocab_size)
    rows = [row for row in with_penalties if row not in windowed]
    if not rows:
        return
    device = logits.device
    picked = [states[row] for row in rows]
    index = torch.tensor(rows, device=device)
    sub = logits[index]
    outputs = _padded([state.output for state in picked], vocab_size, device)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=sub.dtype, device=device)
    counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=sub.dtype))
    counts = counts[:, :vocab_size]
    in_output = counts > 0
    in_context = in_output.clone()  # prompt or output: what repetition_penalty looks at
    for position, state in enumerate(picked):
        window = state.params.repeat_last_n
        if state.params.repetition_penalty == 1.0:
            continue
        if window is None:
            in_context[position] |= state.prompt_mask(vocab_size, device)
        else:  # llama.cpp's rule: only the last `window` tokens of prompt + output
            in_context[position] = False
            in_context[position, state.recent_tokens(window, vocab_size)] = True

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=sub.dtype, device=device).unsqueeze(1)

    repetition = column([state.params.repetition_penalty for state in picked])
    penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub = torch.where(in_context, penalized, sub)
    sub -= column([state.params.frequency_penalty for state in picked]) * counts
    sub -= column([state.params.presence_penalty for state in picked]) * in_output
    logits[index] = sub


def _window_only(params: SamplingParams) -> bool:
    others = params.presence_penalty or params.frequency_penalty
    return params.repeat_last_n is not None and not others


def _apply_recent_repetition(
    logits: torch.Tensor, picked: list[tuple[int, _SeqState]], vocab_size: int
) -> None:
    """repetition_penalty on each row's last repeat_last_n tokens, as the dense rule would."""
    rows: list[int] = []
    tokens: list[int] = []
    factors: list[float] = []
    for row, state in picked:
        window = state.params.repeat_last_n or 0
        recent = state.recent_tokens(window, vocab_size)
        rows += [row] * len(recent)
        tokens += recent
        factors += [state.params.repetition_penalty] * len(recent)
    if not rows:
        return
    where = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
    values = logits[where]
    factor = torch.tensor(factors, dtype=values.dtype, device=logits.device)
    logits[where] = torch.where(values > 0, values / factor, values * factor)


def _apply_min_tokens(logits: torch.Tensor, states: list[_SeqState], vocab_size: int) -> None:
    """Stop tokens (and EOS unless ignore_eos) cannot be sampled before min_tokens are out."""
    rows: list[int] = []
    columns: list[int] = []
    for row, state in enumerate(states):
        if state.min_tokens_pending():
            for token in state.banned_early:
                if 0 <= token < vocab_size:
                    rows.append(row)
                    columns.append(token)
    if rows:
        logits[rows, columns] = -math.inf


# (final logits of the random rows, their rows in the batch, seeds, positions) -> tokens
RandomDraw = Callable[[torch.Tensor, list[int], list[int], list[int]], torch.Tensor]


def _gumbel_draw(
    logits: torch.Tensor, rows: list[int], seeds: list[int], positions: list[int]
) -> torch.Tensor:
    return gumbel_argmax(logits, seeds, positions)


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _MIN_TEMPERATURE


def _sample_random(
    logits: torch.Tensor, states: list[_SeqState], rows: list[int], draw: RandomDraw | None
) -> torch.Tensor:
    """`draw` None: the plain draw, on the top-k candidates where every row keeps few."""
    params = [state.params for state in states]
    seeds, positions = [s.seed for s in states], [s.position for s in states]
    if draw is None and takes_top_k_draw(params, logits.shape[1]):
        return top_k_draw(logits, params, seeds, positions)
    return (draw or _gumbel_draw)(final_logits(logits, params), rows, seeds, positions)


def final_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Random rows' logits as sampled: / temperature, then min_p, top_k and top_p."""
    device = logits.device
    vocab_size = logits.shape[1]
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    logits = logits / temperature
    min_p = [p.min_p for p in params]
    if any(value > 0.0 for value in min_p):
        probs = torch.softmax(logits, dim=-1)
        threshold = torch.tensor(min_p, device=device).unsqueeze(1) * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, -math.inf)
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab_size for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Keep each row's k largest logits, then the smallest set of the largest whose probability
    (renormalized after top-k) reaches p. (At an exact tie with the k-th value, either may stay.)
    """
    device = logits.device
    width = max(top_k)
    if width < logits.shape[1]:  # every row truncates: rank only the top `width`
        ordered, order = logits.topk(width, dim=-1)
    else:
        ordered, order = logits.sort(dim=-1, descending=True)
    kth = torch.tensor(top_k, device=device).unsqueeze(1) - 1
    ordered = ordered.masked_fill(ordered < ordered.gather(1, kth), -math.inf)
    probs = torch.softmax(ordered, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # probability mass ranked strictly above
    keep_sorted = (before < torch.tensor(top_p, device=device).unsqueeze(1)) & (ordered > -math.inf)
    keep_sorted[:, 0] = True  # the most likely token always stays
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter(1, order, keep_sorted)
    return logits.masked_fill(~keep, -math.inf)


def _gather_logprobs(
    raw_logprobs: torch.Tensor, chosen: torch.Tensor, states: list[_SeqState]
) -> list[SampledLogprobs]:
    sampled = raw_logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    num_top = max(state.params.logprobs or 0 for state in states)
    if num_top:
        top_values, top_ids = raw_logprobs.topk(num_top, dim=-1)
        values, ids = top_values.tolist(), top_ids.tolist()
    out = []
    for row, state in enumerate(states):
        count = state.params.logprobs or 0
        if count:
            out.append(SampledLogprobs(sampled[row], ids[row][:count], values[row][:count]))
        else:
            out.append(SampledLogprobs(sampled[row], [], []))
    return out
