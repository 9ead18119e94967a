"""How big the engine's parts are, from Settings and the model's config: the placement of ranks,
each rank's threads, one rank's KV cache budget, the context length, the kernel backend, and the
scheduler's configuration (its block count and limits). engine/launch/plan.py turns these
figures into children, rings and segments.

This module never imports torch: the root process only reads config.json.
"""

from __future__ import annotations

import logging
from typing import TypedDict

from engine.launch.draft import DraftFootprint
from engine.launch.lora import max_loras_of
from engine.launch.pd_plan import replica_roles
from engine.messages.ring_catalogue import PLAN_RING
from engine.model.architectures.limits import check_combination
from engine.model.config import SLIDING, ModelConfig
from engine.model.parallel.config import Placement
from engine.model.parallel.layout import check_tensor_parallel
from engine.model.placement.capacity import available_cpu_memory, kv_block_bytes
from engine.model.placement.policy import (
    ThreadPolicy,
    available_cores,
    device_type,
    oversubscription,
    resident_weight_bytes,
    resolve_device,
    thread_policy,
)
from engine.model.placement.policy import kv_cache_bytes as placement_kv_cache_bytes
from engine.model.quantized.formats import WeightFormat, quantized_bytes
from engine.scheduler.config import SchedulerConfig, longest_in_a_plan
from engine.settings import Settings

log = logging.getLogger("engine.launch.plan")


def check_parallel(settings: Settings, config: ModelConfig) -> Placement:
    """The topology's placement; ValueError naming the setting, its value and what fits."""
    parallel = settings.parallel
    replicas = len(replica_roles(settings))  # P/D's prefill + decode replicas, else dp
    placement = Placement(
        parallel.tensor_parallel_size,
        replicas,
        parallel.nnodes,
        parallel.node_rank,
    )
    placement.validate()
    check_tensor_parallel(config, parallel.tensor_parallel_size)
    on_gpu = device_type(resolve_device(settings.model.device)) == "cuda"
    kernels = settings.model.kernel_backend
    check_combination(
        config,
        tensor_parallel_size=parallel.tensor_parallel_size,
        lora=settings.lora.enable_lora,
        kernels="triton" if kernels == "auto" and on_gpu else kernels,
    )
    if parallel.nnodes > 1:
        if parallel.master_port == 0:
            raise ValueError(
                f"parallel.master_port must be set (1..65535) when parallel.nnodes is "
                f"{parallel.nnodes}: the ranks of every host meet rank 0's TCP store there"
            )
        last = parallel.master_port + replicas - 1
        if last > 65535:
            raise ValueError(
                f"parallel.master_port {parallel.master_port} leaves no port for replica "
                f"{replicas - 1} (it uses master_port + replica index, {last})"
            )
    return placement


def check_pd_device(roles: tuple[str, ...], device: str) -> None:
    """P/D replicas (`roles` other than "both") only where they can run."""
    if any(role != "both" for role in roles) and device_type(device) != "cpu":
        raise ValueError(
            f"P/D disaggregation runs on the CPU only for now (its KV cache is shared with the "
            f"kv_transfer actor through shared memory); model.device is {device}"
        )


def threads_per_rank(settings: Settings, device: str, placement: Placement) -> ThreadPolicy | None:
    """torch threads of each worker rank, per step; None on a GPU (torch's own default)."""
    if device_type(device) != "cpu":
        return None
    cores = available_cores()
    policy = thread_policy(
        settings.runtime.worker_threads,
        cores,
        placement.local_ranks,
        batch_invariant=settings.model.deterministic,
    )
    crowded = oversubscription(placement.local_ranks, policy.busy, cores)
    if crowded is not None:
        log.warning("%s", crowded)
    return policy


class ThreadFields(TypedDict):
    num_threads: int | None
    busy_threads: int | None


def thread_fields(policy: ThreadPolicy | None) -> ThreadFields:
    """WorkerConfig's thread fields for a policy (None: the device's default)."""
    if policy is None:
        return {"num_threads": None, "busy_threads": None}
    return {"num_threads": policy.light, "busy_threads": policy.busy}


def kv_cache_bytes(
    settings: Settings,
    config: ModelConfig,
    device: str,
    dtype: str,
    ranks: int,
    quantized: dict[str, WeightFormat] | None = None,
    draft: DraftFootprint | None = None,
    available_memory: int | None = None,
) -> int:
    """One rank's KV cache budget (see placement.kv_cache_bytes), the draft's cache included;
    `quantized`: the weights served quantized (engine/model/quantized/formats.py), counted by
    their packed bytes; `draft`: a draft model's, whose weights are counted with the target's;
    `available_memory`: the memory to size from (None: what the machine has free now)."""
    tp = settings.parallel.tensor_parallel_size
    if settings.cache.kv_cache_memory is None and device_type(device) != "cpu":
        # The root cannot see a GPU's free memory; the workers will (issue: GPU sizing).
        raise ValueError("cache.kv_cache_memory must be set when running on a GPU")
    if available_memory is None:
        available_memory = available_cpu_memory() if device_type(device) == "cpu" else 0
    weights = resident_weight_bytes(
        config, dtype, tp, device, quantized_bytes(quantized or {}, config)
    )
    return placement_kv_cache_bytes(
        kv_cache_memory=settings.cache.kv_cache_memory,
        memory_fraction=settings.cache.kv_cache_fraction,
        available_memory=available_memory,
        weights_per_rank=weights + (draft.weight_bytes if draft else 0),
        ranks_on_device=ranks,
        device=device,
    )


def kv_cache_blocks(
    settings: Settings,
    config: ModelConfig,
    device: str,
    dtype: str,
    kv_dtype: str,
    ranks: int,
    quantized: dict[str, WeightFormat] | None = None,
    draft: DraftFootprint | None = None,
    available_memory: int | None = None,
) -> int:
    """One rank's KV cache in blocks (the scheduler's block count): kv_cache_bytes over a
    block's bytes, with a draft's block beside each of the target's (the draft's cache has as
    many blocks), so that target and draft together stay within the budget. `dtype`: the
    weights'; `kv_dtype`: the cache's."""
    tp = settings.parallel.tensor_parallel_size
    block_bytes = kv_block_bytes(config, settings.cache.block_size, kv_dtype, tp)
    if draft is not None:
        block_bytes += draft.block_bytes
    budget = kv_cache_bytes(
        settings, config, device, dtype, ranks, quantized, draft, available_memory
    )
    return budget // block_bytes


def max_model_len_of(settings: Settings, config: ModelConfig, kv_tokens: int | None = None) -> int:
    """model.max_model_len, checked against the model's positions. Unset: the model's context,
    or, where less, what the KV cache holds (`kv_tokens`, when known) and a step plan carries,
    said in the start log, as llama-server and Ollama start on any file. (A value set that the
    cache cannot hold is refused by SchedulerConfig.validate.)"""
    requested_len = settings.model.max_model_len
    positions = config.max_position_embeddings
    if requested_len is not None and requested_len > positions:
        raise ValueError(
            f"model.max_model_len {requested_len} exceeds the model's "
            f"max_position_embeddings {positions}"
        )
    if requested_len is not None or kv_tokens is None:
        return requested_len or positions
    plan_limit = longest_in_a_plan(max_plan_bytes())
    fitting = max(2, min(positions, kv_tokens, plan_limit))
    if fitting < positions:
        held = "a step plan carries" if fitting == plan_limit else "the KV cache holds"
        log.info(
            "max_model_len %d: what %s, less than the model's context of %d tokens "
            "(--max-model-len sets it; a larger one needs a larger cache: --kv-cache-memory)",
            fitting,
            held,
            positions,
        )
    return fitting


def max_plan_bytes() -> int:
    """A plan frame leaves half the plan ring free."""
    return PLAN_RING.capacity // 2


def log_memory(
    settings: Settings,
    placement: Placement,
    weights: dict[str, int],
    num_blocks: int,
    block_bytes: int,
    dtype: str,
    draft: DraftFootprint | None = None,
) -> None:
    """What one rank's weights and KV cache take, as the start log shows it; a draft model's
    apart (on each rank 0)."""
    log.info(
        "weights: %.1f MiB per rank (%s)",
        sum(weights.values()) / 2**20,
        ", ".join(f"{kind} {size / 2**20:.1f} MiB" for kind, size in sorted(weights.items())),
    )
    block_size = settings.cache.block_size
    log.info(
        "KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB per rank, %s)%s",
        num_blocks,
        block_size,
        num_blocks * block_size,
        num_blocks * block_bytes / 2**20,
        dtype,
        f"; {len(replica_roles(settings))} replicas x "
        f"{settings.parallel.tensor_parallel_size} ranks"
        if placement.local_ranks > 1 or placement.nnodes > 1
        else "",
    )
    if draft is not None:
        log.info(
            "draft model: weights %.1f MiB, KV cache %.1f MiB (%d blocks)",
            draft.weight_bytes / 2**20,
            num_blocks * draft.block_bytes / 2**20,
            num_blocks,
        )


def kernel_backend_of(settings: Settings) -> str:
    """The kernel backend the workers load: deterministic mode has its own (batch-invariant)."""
    return "batch_invariant" if settings.model.deterministic else settings.model.kernel_backend


def scheduler_config(
    settings: Settings, config: ModelConfig, num_blocks: int, max_model_len: int
) -> SchedulerConfig:
    """The scheduler's part of the settings, checked: a KV cache too small for max_model_len
    fails here, naming both."""
    scheduler = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=settings.cache.block_size,
        max_num_seqs=settings.scheduler.max_num_seqs,
        max_num_batched_tokens=settings.scheduler.max_num_batched_tokens,
        max_model_len=max_model_len,
        default_max_tokens=settings.limits.default_max_tokens,
        enable_prefix_caching=settings.cache.enable_prefix_caching,
        eos_token_ids=list(config.eos_token_ids),
        max_plan_bytes=max_plan_bytes(),
        speculative_config=settings.scheduler.speculative_config,
        max_loras=max_loras_of(settings),
        sliding_window=_window_everywhere(config),
    )
    scheduler.validate()
    return scheduler


def _window_everywhere(config: ModelConfig) -> int:
    """The sliding window when every layer has it (Mistral v0.1, Phi-3-mini); else 0: a global
    layer reads the whole context."""
    if config.sliding_window and all(t == SLIDING for t in config.layer_types):
        return config.sliding_window
    return 0
