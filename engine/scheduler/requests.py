"""The scheduler's view of requests and their sample sequences."""

from __future__ import annotations

import enum
import logging

import msgspec

from engine.kv.cache.block_table import BlockTable
from engine.kv.cache.prefix_cache import BlockHashChain, scope_salt
from engine.messages.params import SamplingParams
from engine.messages.scheduling import SubmitRequest, TenantTag
from engine.messages.steps import NewRequest, NewSeq, PromptLogprobs, SampledLogprobs

_MASK64 = (1 << 64) - 1

log = logging.getLogger(__name__)


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


# Bounds for the size of what a plan carries (messages/steps.py), in msgpack's bytes.
ID_BYTES = 5  # the widest encoding of a token or block id (< 2**32)
ENTRY_BYTES = 32  # the fixed fields of one NewRequest, NewSeq or PlannedChunk


class Request:
    __slots__ = (
        "announcement_bytes",
        "arrival",
        "epoch",
        "first_reported",
        "first_scheduled",
        "held_blocks",
        "key",
        "known_to_workers",
        "kv_handoff",
        "kv_salt",
        "num_cached_tokens",
        "num_preemptions",
        "params",
        "priority",
        "prompt_scores",
        "prompt_token_ids",
        "request_id",
        "samples",
        "seed",
        "tenant",
        "weight",
        "worker_params",
    )

    def __init__(
        self,
        request_id: str,
        epoch: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        arrival: float,
        key: int = 0,
    ) -> None:
        self.request_id = request_id
        self.epoch = epoch
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seed = seed
        self.arrival = arrival
        self.key = key  # names the request to the workers
        self.num_preemptions = 0
        self.kv_handoff = ""  # P/D: hold its KV after its first token (SubmitRequest)
        # Taken when its first chunk is planned, reported with its first token (FirstScheduled).
        self.first_scheduled: float | None = None
        self.num_cached_tokens = 0  # prompt tokens whose KV came from the cache or a sibling
        # Prefix blocks it holds (a reference each) from its arrival until its first chunk is
        # planned: what the disk tier read back for it (engine/scheduler/disk_tier.py).
        self.held_blocks: list[int] = []
        self.first_reported = False
        self.samples: dict[int, SequenceState] = {}  # unfinished samples by index
        # Prompt logprobs by position, while they are to be computed and sent (with the first
        # token of the epoch); None when not asked for, or already sent in an earlier epoch.
        self.prompt_scores: dict[int, SampledLogprobs] | None = None
        # Stop strings are matched by the detokenizer: the workers never get them.
        self.worker_params = msgspec.structs.replace(params, stop=[])
        self.known_to_workers = False  # a plan announced it and none has retired it since
        # Whom it runs for (run_for): the default is the one tenant of a server without tenants.
        self.tenant = ""
        self.weight = 1.0
        self.priority = 0
        self.kv_salt = adapter_salt(params)
        self.announcement_bytes = (
            ENTRY_BYTES
            + ID_BYTES * len(prompt_token_ids)
            + len(msgspec.msgpack.encode(self.worker_params))
        )

    @classmethod
    def of(cls, submit: SubmitRequest, arrival: float, key: int) -> Request:
        """The request `submit` asks for, arrived at `arrival`, named `key` to the workers."""
        request = cls(
            submit.request_id,
            submit.epoch,
            submit.prompt_token_ids,
            submit.params,
            submit.seed,
            arrival,
            key,
        )
        request.kv_handoff = submit.kv_handoff if submit.params.n == 1 else ""
        request.run_for(submit.tenant, submit.priority, submit.cache_salt)
        return request

    def run_for(self, tenant: TenantTag | None, priority: int, cache_salt: str | None) -> None:
        """Whom it runs for: its tenant's name and weight (fair share), its priority (lower runs
        first), and what its KV is keyed by beside its tokens: its adapter, its tenant's cache
        scope and its own salt (engine/kv/cache/prefix_cache.py)."""
        if tenant is not None:
            self.tenant, self.weight = tenant.name, tenant.weight
        self.priority = priority
        self.kv_salt = kv_salt(self.params, tenant, cache_salt)

    def announcement(self) -> NewRequest:
        return NewRequest(self.key, self.prompt_token_ids, self.worker_params)

    @property
    def scores_prompt(self) -> bool:
        """Its prompt logprobs are still to come, or its embedding is a MEAN over the prompt:
        its prefill may not skip any prompt token (no prefix-cache hits)."""
        pooling = self.params.pooling
        return self.prompt_scores is not None or (
            pooling is not None and pooling.pooling_type == "MEAN"
        )

    def add_prompt_scores(self, scores: PromptLogprobs) -> None:
        if self.prompt_scores is not None:
            for offset, entry in enumerate(scores.entries):
                self.prompt_scores[scores.first_position + offset] = entry

    def take_prompt_scores(self) -> list[SampledLogprobs] | None:
        """Once, with the epoch's first token: the logprobs of prompt tokens 1.. (token 0 has
        none)."""
        scores = self.prompt_scores
        if scores is None:
            return None
        self.prompt_scores = None
        positions = range(1, len(self.prompt_token_ids))
        missing = [position for position in positions if position not in scores]
        if missing:  # never expected: every prompt token of a scored prefill is computed
            log.error("request %s: no prompt logprobs for positions %s", self.request_id, missing)
            return None
        return [scores[position] for position in positions]


class SequenceState:
    """One sample of a request: prompt + generated tokens, and how much of it has KV."""

    __slots__ = (
        "block_size",
        "block_table",
        "blocks_sent",
        "hash_chain",
        "index",
        "known_to_workers",
        "last_planned",
        "needs_announce",
        "num_computed_tokens",
        "num_prompt_tokens",
        "request",
        "seed",
        "seq_id",
        "status",
        "token_ids",
    )

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
        self.block_size = block_size
        self.block_table = BlockTable()
        self.blocks_sent = 0  # of block_table's ids, those the workers have
        self.hash_chain = BlockHashChain(block_size, request.kv_salt)
        self.last_planned = -1  # the planner's step that last ran it (decodes take turns)
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
        return NewSeq(self.seq_id, self.request.key, self.output_token_ids(), self.seed)

    def plan_bytes(self, num_tokens: int, covered_tokens: int) -> int:
        """At most the bytes a chunk of `num_tokens` of this sequence adds to a plan, with its
        own announcement and its request's when the workers need them; `covered_tokens`: how
        far its block table reaches after the chunk."""
        size = ENTRY_BYTES + ID_BYTES * num_tokens
        end_blocks = -(-covered_tokens // self.block_size)
        if self.needs_announce:  # the whole table, the history and maybe the request
            size += ENTRY_BYTES + ID_BYTES * (end_blocks + self.num_output_tokens)
            if not self.request.known_to_workers:
                size += self.request.announcement_bytes
        else:
            size += ID_BYTES * (end_blocks - self.blocks_sent)
        return size

    def __repr__(self) -> str:
        return (
            f"SequenceState(id={self.seq_id}, {self.request.request_id}#{self.index}, "
            f"{self.status.value}, tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )


def kv_salt(params: SamplingParams, tenant: TenantTag | None, cache_salt: str | None) -> bytes:
    """What the prefix cache keys a request's KV by beside its tokens (every tier, and the KV
    that P/D moves): its adapter, its tenant's cache scope and its own salt."""
    scope = "" if tenant is None else tenant.cache_scope
    return adapter_salt(params) + scope_salt(scope, cache_salt)


def submitted_kv_salt(submit: SubmitRequest) -> bytes:
    return kv_salt(submit.params, submit.tenant, submit.cache_salt)


def adapter_salt(params: SamplingParams) -> bytes:
    """What the prefix cache keys a sequence's KV by beside its tokens: its LoRA adapter, which
    changes every layer's keys and values (b"": the base model)."""
    lora = params.lora_request
    if lora is None:
        return b""
    return f"lora\0{lora.lora_name}\0{lora.lora_int_id}\0{lora.lora_path}".encode()


def sample_starts(submit: SubmitRequest) -> list[tuple[int, list[int]]]:
    """(index, tokens it delivered) of each sample still to finish: all of a new request's, a
    resumed one's listed."""
    if submit.resume is None:
        return [(index, []) for index in range(submit.params.n)]
    return [(item.index, item.delivered_token_ids) for item in submit.resume]
