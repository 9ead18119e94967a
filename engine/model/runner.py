"""ModelRunner: a loaded model plus its paged KV cache, run one step of SeqChunks at a time.

The runner knows nothing about scheduling: the chunks say which tokens to run, where they sit
in their sequences and which cache blocks hold them. It writes their K/V and returns logits for
the chunks that end a sequence's known tokens (sample=True).

Under tensor parallelism every rank of the group runs the same chunks through its shard of the
model (and its shard of the KV cache: its KV heads); the logits arrive on rank 0 only.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.kernels.attention_metadata import AttentionMetadata, long_tensor
from engine.kernels.kv_cache import PagedKVCache
from engine.kernels.registry import select_backend
from engine.model.config import ModelConfig, load_model_config
from engine.model.loading.loader import load_model, resolve_dtype
from engine.model.loading.weight_cache import CacheSlot
from engine.model.loading.weight_store import StoreSlot
from engine.model.lora.weights import AdapterCache, LoraStep
from engine.model.parallel.group import TensorParallelGroup
from engine.model.placement import policy as placement
from engine.model.placement.capacity import (
    available_cpu_memory,
    kv_block_bytes,
    kv_cache_blocks,
)
from engine.model.placement.host_memory import keep_freed_memory, release_freed_memory
from engine.model.quantized.formats import describe_formats, quantized_bytes, quantized_gguf
from engine.model.step_inputs import SeqChunk
from engine.quantization.layout import LAYOUT_VERSION
from engine.settings.schema import CacheSettings

__all__ = ["ModelRunner", "kv_cache_blocks"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PreparedStep:
    """A step's model inputs (ModelRunner.prepare), ready for ModelRunner.execute."""

    token_ids: torch.Tensor | None  # None: an empty step
    attention: AttentionMetadata | None
    # Rows of the step's tokens whose logits are computed, in order: each sampled chunk's last
    # token, and every token of the chunks asked for in full (prompt logprobs).
    logit_rows: list[int]
    keys: int = 0  # at most this many keys read by its attention per layer (thread count)
    lora: LoraStep | None = None  # the rows that run with LoRA adapters


class ModelRunner:
    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "auto",
        device: str = "cpu",
        block_size: int = 16,
        kv_cache_memory: int | None = None,
        kv_cache_fraction: float = CacheSettings().kv_cache_fraction,
        max_model_len: int | None = None,
        num_threads: int | None = None,
        busy_threads: int | None = None,
        kernel_backend: str = "auto",
        quantization: str = "auto",
        tensor_parallel: TensorParallelGroup | None = None,
        kv_cache_buffer: Any = None,
        weights_of_run: str | None = None,
        max_lora_rank: int = 0,
        max_cpu_loras: int = 8,
        kv_cache_dtype: str = "auto",
    ) -> None:
        """`kv_cache_buffer`: memory the KV cache must live in (a shared-memory segment its
        kv_transfer actor maps too); None: the cache allocates its own. `weights_of_run`: the
        run directory (engine/runtime/shm.py) whose restarts of this rank map its weights rather
        than read the checkpoint again (engine/model/loading/weight_store.py; CPU only); None: no
        store.
        `max_lora_rank` > 0: chunks may name LoRA adapters of at most that rank, loaded on first
        use and `max_cpu_loras` of them kept loaded. `kv_cache_dtype`: the cache's
        (placement.resolve_kv_cache_dtype)."""
        if block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size}")
        self.model_path = str(Path(model_path))
        self.group = tensor_parallel or TensorParallelGroup()
        self.device = torch.device(placement.resolve_device(str(device)))
        if self.device.type == "cpu":
            keep_freed_memory()
        self.threads = _thread_policy(self.device, num_threads, busy_threads, kernel_backend)
        if self.threads is not None:
            torch.set_num_threads(self.threads.light)
        self.config: ModelConfig = load_model_config(model_path, max_model_len)
        self.dtype = resolve_dtype(dtype, self.config, self.device)
        self.backend = select_backend(self.device, kernel_backend)
        if self.threads is not None and self.backend.set_max_threads is not None:
            self.backend.set_max_threads(self.threads.busy)
        self.weight_slot = self._weight_slot(quantization, weights_of_run)
        self._load_weights(quantization)
        self.loras: AdapterCache | None = None
        if max_lora_rank > 0:
            if self.group.size > 1:
                raise ValueError("LoRA adapters are not supported with tensor parallelism")
            self.loras = AdapterCache(
                self.config, max_lora_rank, self.dtype, self.device, max_cpu_loras
            )
        self.block_size = block_size
        kv_name = placement.resolve_kv_cache_dtype(
            kv_cache_dtype,
            str(self.dtype).removeprefix("torch."),
            self.device.type,
            self.backend.name,
            quantized=bool(self.model.weight_formats),
        )
        self.kv_cache_dtype: torch.dtype = getattr(torch, kv_name)
        self._allocate_kv_cache(kv_cache_memory, kv_cache_fraction, kv_cache_buffer)

    def _weight_slot(self, quantization: str, weights_of_run: str | None) -> StoreSlot | None:
        """Where this rank's loaded weights are kept for later starts (CPU only): a GGUF file's
        repacked quantized weights on disk beside what is derived from it, for every start
        (engine/model/loading/weight_cache.py); other weights in the run's segment, for its
        restarts."""
        if self.device.type != "cpu":
            return None
        identity = self._weights_identity(quantization)
        if quantized_gguf(self.model_path, self.config, quantization, self.group.size):
            return CacheSlot(self.model_path, identity)
        return None if weights_of_run is None else StoreSlot(weights_of_run, identity)

    def _weights_identity(self, quantization: str) -> str:
        """Everything this rank's loaded weights depend on, in words."""
        return (
            f"{self.model_path} dtype={str(self.dtype).removeprefix('torch.')} "
            f"quantization={quantization} kernels={self.backend.name} device={self.device} "
            f"rank={self.group.rank}/{self.group.size} layout={LAYOUT_VERSION}"
        )

    def _load_weights(self, quantization: str) -> None:
        self.model = load_model(
            self.model_path,
            self.config,
            dtype=self.dtype,
            device=self.device,
            ops=self.backend,
            group=self.group,
            quantization=quantization,
            store=self.weight_slot,
        )
        self.shape = self.model.shape  # this rank's heads, KV heads, columns, vocabulary rows
        if self.device.type == "cpu":
            release_freed_memory()
        dtype = str(self.dtype).removeprefix("torch.")
        self.weight_bytes = placement.resident_weight_bytes(
            self.config,
            dtype,
            self.group.size,
            self.device.type,
            quantized_bytes(self.model.weight_formats, self.config),
        )
        log.info(
            "weights: %.1f MiB resident (%s)",
            self.weight_bytes / 2**20,
            describe_formats(self.model.weight_formats, dtype),
        )
        log.info("layers: %s", self.model.layer_path())

    def _allocate_kv_cache(
        self, kv_cache_memory: int | None, kv_cache_fraction: float, buffer: Any
    ) -> None:
        """As many KV blocks as the budget holds (what the memory left after the weights
        allows, when no size is given), in `buffer` when one is given."""
        kv_cache_memory = placement.kv_cache_bytes(
            kv_cache_memory=kv_cache_memory,
            memory_fraction=kv_cache_fraction,
            available_memory=_free_memory(self.device),
            weights_per_rank=self.weight_bytes,
            ranks_on_device=1,
            device=self.device.type,
        )
        block_bytes = kv_block_bytes(
            self.config, self.block_size, self.kv_cache_dtype, self.group.size
        )
        self.num_blocks = kv_cache_memory // block_bytes
        if self.num_blocks < 1:
            raise ValueError(
                f"a KV cache of {kv_cache_memory} bytes holds no block: one block of "
                f"{self.block_size} tokens needs {block_bytes} bytes"
            )
        self.kv_cache = PagedKVCache(
            num_layers=self.config.num_layers,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_kv_heads=self.shape.num_kv_heads,
            head_dim=self.config.head_dim,
            dtype=self.kv_cache_dtype,
            device=self.device,
            buffer=buffer,
        )
        log.info(
            "%s%s on %s (%s threads) in %s (%s kernels): "
            "KV cache of %d blocks x %d = %d tokens (%.1f MiB, %s)",
            self.config.architecture,
            f" (tensor-parallel rank {self.group.rank} of {self.group.size})"
            if self.group.size > 1
            else "",
            self.device,
            describe_threads(self.threads),
            str(self.dtype).removeprefix("torch."),
            self.backend.name,
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_size,
            self.num_blocks * block_bytes / 2**20,
            str(self.kv_cache_dtype).removeprefix("torch."),
        )

    def forward(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """Run one step; float32 logits [chunks with sample=True, vocab], in plan order (on
        tensor-parallel ranks other than 0: an empty [0, vocab] tensor)."""
        return self.execute(self.prepare(chunks))

    @torch.inference_mode()
    def prepare(self, chunks: Sequence[SeqChunk], every_row: Collection[int] = ()) -> PreparedStep:
        """A step's inputs, checked: everything that happens on this rank alone, before the
        first collective (so a failure here can be agreed on by the ranks: engine/model/step).
        The chunks of the sequences in `every_row` get logits for every token, not only the
        sampled last one (see PreparedStep.logit_rows)."""
        if not chunks:
            return PreparedStep(None, None, [])
        self._check(chunks)
        vocab = self.config.vocab_size
        token_ids: list[int] = []
        logit_rows: list[int] = []
        for chunk in chunks:
            first = len(token_ids)
            token_ids += chunk.token_ids
            if chunk.seq_id in every_row:
                logit_rows += range(first, len(token_ids))
            elif chunk.sample:  # the last token's row, and one per proposal to verify
                logit_rows += range(len(token_ids) - 1 - chunk.num_proposed, len(token_ids))
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            bad = next(t for t in token_ids if not 0 <= t < vocab)
            raise ValueError(f"token id {bad} is out of range; expected 0 <= id < {vocab}")
        attention = self.backend.build_attention_metadata(
            [len(chunk.token_ids) for chunk in chunks],
            [chunk.start_pos for chunk in chunks],
            [chunk.block_table for chunk in chunks],
            cache=self.kv_cache,
            queries_per_kv=self.shape.queries_per_kv,
            device=self.device,
        )
        keys = sum(len(c.token_ids) * (c.start_pos + len(c.token_ids)) for c in chunks)
        tokens = long_tensor(token_ids).to(self.device)
        return PreparedStep(tokens, attention, logit_rows, keys, self._lora_step(chunks))

    def _lora_step(self, chunks: Sequence[SeqChunk]) -> LoraStep | None:
        """The step's rows by adapter, each adapter loaded (ValueError: one that cannot be)."""
        if all(chunk.lora is None for chunk in chunks):
            return None
        if self.loras is None:
            raise ValueError("a chunk names a LoRA adapter, but LoRA is not enabled")
        loras = self.loras
        adapters = [None if c.lora is None else loras.get(c.lora) for c in chunks]
        return LoraStep.of([len(chunk.token_ids) for chunk in chunks], adapters, self.device)

    def execute(self, step: PreparedStep) -> torch.Tensor:
        """The model on a prepared step (the collectives of tensor parallelism happen here)."""
        return self.execute_pooled(step, [])[0]

    @torch.inference_mode()
    def execute_pooled(
        self, step: PreparedStep, pool_rows: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`execute`, and the final-normed hidden states of the step's token rows `pool_rows`
        (embeddings: engine/model/pooling.py); None when none are asked for."""
        vocab = self.config.vocab_size
        empty = torch.empty(0, vocab, dtype=torch.float32, device=self.device)
        if step.token_ids is None or step.attention is None:
            return empty, None
        if self.threads is not None:
            threads = self.threads.threads_for(len(step.token_ids), step.keys)
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        hidden = self.model(step.token_ids, step.attention, self.kv_cache, step.lora)
        pooled = None
        if pool_rows:
            pooled = self.model.norm(hidden[long_tensor(list(pool_rows)).to(self.device)])
        return self._logits(step, hidden, empty), pooled

    def _logits(
        self, step: PreparedStep, hidden: torch.Tensor, empty: torch.Tensor
    ) -> torch.Tensor:
        if not step.logit_rows:
            return empty
        if len(step.logit_rows) < hidden.shape[0]:
            hidden = hidden[long_tensor(step.logit_rows).to(self.device)]
        logits = self.model.compute_logits(hidden)
        if logits is None:  # a rank other than 0: rank 0 has gathered the logits
            return empty
        return logits

    def _check(self, chunks: Sequence[SeqChunk]) -> None:
        limit = self.config.max_model_len
        for chunk in chunks:
            if not chunk.token_ids:
                raise ValueError(f"chunk of sequence {chunk.seq_id} has no tokens")
            if chunk.start_pos < 0:
                raise ValueError(
                    f"chunk of sequence {chunk.seq_id} has start_pos {chunk.start_pos}; "
                    "expected >= 0"
                )
            if chunk.start_pos + len(chunk.token_ids) > limit:
                raise ValueError(
                    f"chunk of sequence {chunk.seq_id} reaches position "
                    f"{chunk.start_pos + len(chunk.token_ids) - 1}; max_model_len is {limit}"
                )


def _thread_policy(
    device: torch.device, num_threads: int | None, busy_threads: int | None, kernel_backend: str
) -> placement.ThreadPolicy | None:
    """The threads asked for; else, on the CPU, those of one rank alone on this host; None on a
    GPU (torch's default)."""
    if num_threads is None:
        if device.type != "cpu":
            return None
        batch_invariant = kernel_backend == "batch_invariant"
        return placement.thread_policy(0, placement.available_cores(), 1, batch_invariant)
    for name, value in (("num_threads", num_threads), ("busy_threads", busy_threads)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    return placement.ThreadPolicy(num_threads, busy_threads or num_threads)


def describe_threads(threads: placement.ThreadPolicy | None) -> str:
    if threads is None:
        return str(torch.get_num_threads())
    if threads.light == threads.busy:
        return str(threads.light)
    return (
        f"{threads.light}, {threads.busy} for steps of >= {threads.busy_from_tokens} tokens or "
        f">= {threads.busy_from_keys} keys"
    )


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return available_cpu_memory()
