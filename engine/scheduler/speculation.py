"""Speculative decoding's scheduler side: n-gram (prompt-lookup) proposals, draft-model
proposals' reservations, and their tally.

A decoding sequence whose last tokens occurred earlier in its prompt or output gets the tokens
that followed that occurrence as proposals. The step then runs the sequence's decode token and
the k proposals as one chunk of 1 + k tokens; worker rank 0 samples every position
(engine/model/speculation/verify.py) and returns the proposals it accepted plus one token of its
own.
The KV of rejected positions was written but is never read: the sequence's computed length is
rolled back to what was accepted, and those slots are written again by later steps.

With a draft model ("model" in the config) the scheduler proposes no tokens: it reserves the
blocks of k more and asks worker rank 0 to draft them (PlannedChunk.num_draft), which it does
before verifying them in the same step (engine/model/speculation/drafter.py). The rest is the same.

Proposals never change which tokens come out, only how many come per step: a proposal stands
where it equals the target's own draw. Only `"acceptance_method": "rejection_sampler"` (vLLM's
rule, for a draft model's proposals of sampled requests) gives the same distribution but not
the same draws as without speculation.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import NamedTuple

import msgspec

from engine.kv.cache.block_manager import BlockManager
from engine.scheduler.policy import ScheduledChunk
from engine.scheduler.requests import SequenceState
from engine.scheduler.stopping import max_output_tokens

METHODS = ("ngram", "draft_model")
# How a sampled request's draft proposals are verified (engine/model/speculation/verify.py):
# equal to the target's own draw (the default), or vLLM's rejection sampling against the draft's q.
ACCEPTANCE_METHODS = ("target_draw", "rejection_sampler")


class SpeculativeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """vLLM's --speculative-config: the n-gram and draft-model methods' fields."""

    method: str = ""  # "": "draft_model" when a model is named, else "ngram" (as vLLM)
    model: str = ""  # the draft model: a checkpoint directory or GGUF file, as model.path
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    acceptance_method: str = "target_draw"  # one of ACCEPTANCE_METHODS (vLLM v0's key)

    @property
    def kind(self) -> str:
        return self.method or ("draft_model" if self.model else "ngram")

    def validate(self) -> None:
        if self.kind not in METHODS:
            raise ValueError(
                f"speculative_config method must be one of {list(METHODS)}, got {self.method!r}"
            )
        if (self.kind == "draft_model") != bool(self.model):
            raise ValueError(
                "speculative_config: a model is named with method draft_model, and only then; "
                f"got method {self.kind!r}, model {self.model!r}"
            )
        if self.acceptance_method not in ACCEPTANCE_METHODS:
            raise ValueError(
                f"speculative_config acceptance_method must be one of {list(ACCEPTANCE_METHODS)}, "
                f"got {self.acceptance_method!r}"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError(
                "speculative_config num_speculative_tokens must be an integer >= 1, got "
                f"{self.num_speculative_tokens!r}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"prompt_lookup_min={self.prompt_lookup_min!r}, "
                f"prompt_lookup_max={self.prompt_lookup_max!r}"
            )


def parse_speculative_config(text: str) -> SpeculativeConfig | None:
    """The JSON text of --speculative-config; None for an empty text (speculation off).

    ValueError names what was wrong (not JSON, an unknown field, a value out of range)."""
    if not text.strip():
        return None
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"speculative_config is not JSON ({exc}): {text!r}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {text!r}")
    try:
        config = msgspec.convert(fields, SpeculativeConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"speculative_config: {exc}") from None
    config.validate()
    return config


def propose_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the first earlier occurrence of the longest suffix of
    `tokens` of length in [min_n, max_n]; [] when no such suffix occurred before.

    The first occurrence, as vLLM's scan finds it: in a copy (repeating, editing or
    refactoring a given text) the source is the prompt, which comes first, while a later
    occurrence is often in the output's own rewording, which is what just diverged."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        start = 0
        while True:  # candidate starts: positions holding the suffix's first token, in order
            try:
                start = tokens.index(suffix[0], start, length - n)  # list.index: a C loop
            except ValueError:
                break
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
            start += 1
    return []


class SpeculationTally:
    """vLLM's spec_decode counters, since start."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_speculative_tokens

    def figures(self) -> dict[str, int | list[int]]:
        """SchedulerFigures' spec_decode_* fields."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
        }

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


# A sequence whose proposals were all rejected proposes nothing for 2, 4, ... up to this many
# steps, and then one token only until one is accepted (ProposalLength).
MAX_PAUSE_STEPS = 32


class ProposalLength:
    """How many proposals each sequence gets at its next step, from how its last ones fared.

    A step verifying k proposals costs more than a plain decode step (on the CPU each one is
    another row through every matmul and another query through attention; a draft model runs
    k times), so the length follows the text:
    - at first, `most` (num_speculative_tokens); after a draft accepted whole at its full
      length, twice that length, up to `most`: while text is being copied, runs hold;
    - after a draft cut short with `a` accepted, a + 1: the text diverged from what it copied,
      and the next match is less sure;
    - after a draft rejected whole, none for 2, 4, ... MAX_PAUSE_STEPS steps, then one at a time
      until one is accepted: text where proposals keep missing must not pay for them each step.
    Proposals never change which tokens come out, so none of this changes the output."""

    def __init__(self, most: int) -> None:
        self.most = most
        self._length: dict[int, int] = {}  # seq id -> its next draft's length (absent: most)
        self._misses: dict[int, int] = {}  # seq id -> drafts rejected whole in a row
        self._paused_until: dict[int, int] = {}  # seq id -> the step it may propose again

    def limit(self, seq_id: int, step: int) -> int:
        """Proposals `seq_id` may get at `step` (0 while paused)."""
        if self._paused_until.get(seq_id, 0) > step:
            return 0
        return self._length.get(seq_id, self.most)

    def record(self, seq_id: int, proposed: int, accepted: int, step: int) -> None:
        """The outcome of `seq_id`'s draft of `proposed` tokens at `step`."""
        if not accepted:
            misses = self._misses.get(seq_id, 0) + 1
            self._misses[seq_id] = misses
            self._paused_until[seq_id] = step + min(2**misses, MAX_PAUSE_STEPS)
            self._length[seq_id] = 1  # a probe
            return
        self._misses.pop(seq_id, None)
        length = self._length.get(seq_id, self.most)
        if accepted < proposed:
            self._length[seq_id] = accepted + 1
        elif proposed >= length:  # accepted whole at full length (not cut by lookup or room)
            self._length[seq_id] = min(self.most, 2 * length)

    def forget(self, seq_id: int) -> None:
        self._length.pop(seq_id, None)
        self._misses.pop(seq_id, None)
        self._paused_until.pop(seq_id, None)


class Proposal(NamedTuple):
    """A decode chunk's proposals: n-gram tokens, or a number for the draft model to draw."""

    tokens: list[int]
    num_draft: int = 0

    @property
    def size(self) -> int:
        return len(self.tokens) + self.num_draft


class Speculator:
    """Proposes tokens for a step's decode chunks and reserves KV blocks for them."""

    def __init__(
        self,
        config: SpeculativeConfig,
        kv: BlockManager,
        max_model_len: int,
        default_max_tokens: int = 0,
    ) -> None:
        self.config = config
        self.default_max_tokens = default_max_tokens
        self.kv = kv
        self.max_model_len = max_model_len
        self.tally = SpeculationTally(config.num_speculative_tokens)
        self.lengths = ProposalLength(config.num_speculative_tokens)
        self._step = 0

    def forget(self, seq_id: int) -> None:
        self.lengths.forget(seq_id)

    def plan(self, chunks: list[ScheduledChunk], token_budget: int) -> dict[int, Proposal]:
        """Proposals for the decode chunks among a step's `chunks`, by sequence id, within
        the step's `token_budget` left."""
        self._step += 1
        proposals: dict[int, Proposal] = {}
        for chunk in chunks:
            seq = chunk.seq
            if token_budget < 1:
                break
            if chunk.num_tokens != 1 or chunk.start + 1 != seq.num_tokens:
                continue  # a prefill chunk, or one that does not end the sequence
            proposed = self.propose(seq, chunk.start, token_budget)
            if proposed.size:
                proposals[seq.seq_id] = proposed
                token_budget -= proposed.size
        return proposals

    def accepted(self, proposed: dict[int, int], seq_ids: list[int]) -> dict[int, int]:
        """Accepted proposals by sequence id, from a step's result (a sequence's tokens are
        its accepted proposals and one more); tallied."""
        emitted = Counter(seq_ids)
        accepted = {}
        for seq_id, count in proposed.items():
            accepted[seq_id] = min(max(emitted[seq_id] - 1, 0), count)
            if emitted[seq_id]:
                self.tally.record(count, accepted[seq_id])
                self.lengths.record(seq_id, count, accepted[seq_id], self._step)
        return accepted

    def propose(self, seq: SequenceState, start: int, budget: int) -> Proposal:
        """Proposals for `seq`'s decode chunk at `start` (its last token), within `budget`
        extra tokens; their KV blocks are reserved. Empty when none fit or none are found."""
        limit = min(budget, self._room(seq), self.lengths.limit(seq.seq_id, self._step))
        if limit < 1 or not _speculable(seq):
            return Proposal([])
        config = self.config
        if config.kind == "draft_model":
            proposal = Proposal([], limit)
        else:
            found = propose_ngram(
                seq.token_ids, config.prompt_lookup_min, config.prompt_lookup_max, limit
            )
            proposal = Proposal(found)
        if proposal.size and not self.kv.grow(seq.block_table, start + 1 + proposal.size):
            return Proposal([])  # no free block: this step runs without them, no one is preempted
        return proposal

    def _room(self, seq: SequenceState) -> int:
        """Proposals that fit before max_tokens or max_model_len (the step adds one more)."""
        room = min(self.config.num_speculative_tokens, self.max_model_len - seq.num_tokens - 1)
        max_tokens = max_output_tokens(seq.params, self.default_max_tokens)
        if max_tokens is not None:
            room = min(room, max_tokens - seq.num_output_tokens - 1)
        return room


def _speculable(seq: SequenceState) -> bool:
    """A request a P/D prefill instance hands off after its first token: nothing to speculate."""
    return not seq.request.kv_handoff
