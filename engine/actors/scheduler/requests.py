"""The scheduler's view of requests and their sample sequences."""

from __future__ import annotations

import enum

from engine.kv.block_table import BlockTable
from engine.kv.prefix_cache import BlockHashChain
from engine.messages.params import SamplingParams
from engine.messages.steps import NewSeq

_MASK64 = (1 << 64) - 1


def derive_seed(request_seed: int, index: int) -> int:
    """The seed of sample `index`: a fixed mix of (request seed, index), a non-negative int63.

    A function of nothing else, so a resubmitted request samples exactly as before.
    """
    x = (request_seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xD1B54A32D192ED03) & _MASK64
    # splitmix64's finalizer
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return x >> 1


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # holds no KV blocks
    RUNNING = "running"  # holds KV blocks for its computed tokens
    FINISHED = "finished"


class Request:
    __slots__ = ("arrival", "epoch", "num_preemptions", "params", "prompt_token_ids",
                 "request_id", "samples", "seed")  # fmt: skip

    def __init__(
        self,
        request_id: str,
        epoch: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        arrival: float,
    ) -> None:
        self.request_id = request_id
        self.epoch = epoch
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seed = seed
        self.arrival = arrival
        self.num_preemptions = 0
        self.samples: dict[int, Sequence] = {}  # unfinished samples by index


class Sequence:
    """One sample of a request: prompt + generated tokens, and how much of it has KV."""

    __slots__ = ("block_table", "hash_chain", "index", "known_to_workers", "needs_announce",
                 "num_computed_tokens", "num_prompt_tokens", "request", "seed", "seq_id",
                 "status", "token_ids")  # fmt: skip

    def __init__(
        self,
        seq_id: int,
        request: Request,
        index: int,
        output_token_ids: list[int],
        block_size: int,
    ) -> None:
        self.seq_id = seq_id
        self.request = request
        self.index = index
        self.token_ids = [*request.prompt_token_ids, *output_token_ids]
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.seed = derive_seed(request.seed, index)
        self.num_computed_tokens = 0  # tokens whose KV the workers have written
        self.status = SeqStatus.WAITING
        self.block_table = BlockTable()
        self.hash_chain = BlockHashChain(block_size)
        self.needs_announce = True  # the next plan must carry a NewSeq for it
        self.known_to_workers = False  # some plan announced it: it must be retired by name

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def announcement(self) -> NewSeq:
        return NewSeq(
            seq_id=self.seq_id,
            prompt_token_ids=self.request.prompt_token_ids,
            output_token_ids=self.output_token_ids(),
            params=self.request.params,
            seed=self.seed,
        )

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, {self.request.request_id}#{self.index}, "
            f"{self.status.value}, tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
