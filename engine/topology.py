"""From Settings to the actor system: which children, which rings, how big the KV cache is.

The root decides the KV cache's size in blocks once, here, and hands the same number to the
scheduler (which allocates blocks) and, as bytes, to the worker ranks (which allocate tensors);
each rank checks it arrived at the same count. This module never imports torch: the root
process only reads config.json.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import msgspec

from engine.actors.detokenizer import DetokenizerConfig
from engine.actors.runtime.child_spec import ROOT, ChildSpec, RingDecl, Strategy, SupervisorSpec
from engine.actors.scheduler.config import SchedulerConfig
from engine.actors.tokenizer import TokenizerConfig
from engine.actors.worker import WorkerConfig
from engine.model.capacity import available_cpu_memory, kv_block_bytes
from engine.model.config import ModelConfig, load_model_config
from engine.settings import Settings

log = logging.getLogger(__name__)

# On CPU an unset kv_cache_memory means this much at most (vLLM-CPU's default is 4 GiB).
CPU_KV_CACHE_DEFAULT_BYTES = 2 * 2**30
RING_BYTES = 8 * 2**20  # a ring holds several whole steps of a large batch


@dataclass(frozen=True)
class EnginePlan:
    model_path: str
    model_config: ModelConfig
    device: str
    dtype: str
    num_blocks: int
    max_model_len: int
    spec: SupervisorSpec


def resolve_device(requested: str) -> str:
    if requested != "auto":
        return requested
    has_gpu = os.path.exists("/dev/nvidiactl") and os.environ.get("CUDA_VISIBLE_DEVICES") != ""
    return "cuda" if has_gpu else "cpu"


def resolve_dtype(requested: str, config: ModelConfig, device: str) -> str:
    """Same rule as the loader's: auto = the checkpoint's, float32 for float16 on CPU,
    bfloat16 for float32 on a GPU."""
    if requested != "auto":
        return requested
    dtype = config.torch_dtype or "float32"
    if device == "cpu" and dtype == "float16":
        return "float32"
    if device == "cuda" and dtype == "float32":
        return "bfloat16"
    return dtype


def kv_cache_bytes(settings: Settings, device: str) -> int:
    if settings.cache.kv_cache_memory is not None:
        return settings.cache.kv_cache_memory
    if device == "cpu":
        budget = int(available_cpu_memory() * settings.cache.kv_cache_fraction)
        return min(budget, CPU_KV_CACHE_DEFAULT_BYTES)
    # On a GPU the worker knows free memory; a fixed share of a large card until it reports.
    raise ValueError("cache.kv_cache_memory must be set when running on a GPU")


def plan_engine(settings: Settings, model_path: str) -> EnginePlan:
    config = load_model_config(model_path)
    requested_len = settings.model.max_model_len
    if requested_len is not None and requested_len > config.max_position_embeddings:
        raise ValueError(
            f"model.max_model_len {requested_len} exceeds the model's "
            f"max_position_embeddings {config.max_position_embeddings}"
        )
    max_model_len = requested_len or config.max_position_embeddings
    device = resolve_device(settings.model.device)
    dtype = resolve_dtype(settings.model.dtype, config, device)
    block_size = settings.cache.block_size
    block_bytes = kv_block_bytes(config, block_size, dtype)
    num_blocks = kv_cache_bytes(settings, device) // block_bytes
    tp = settings.parallel.tensor_parallel_size
    if tp != 1:
        raise ValueError(f"parallel.tensor_parallel_size {tp} is not supported yet; use 1")
    scheduler = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=settings.scheduler.max_num_seqs,
        max_num_batched_tokens=settings.scheduler.max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=settings.cache.enable_prefix_caching,
        eos_token_ids=list(config.eos_token_ids),
    )
    scheduler.validate()  # a KV cache too small for max_model_len fails here, naming both
    log.info(
        "KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB, %s)",
        num_blocks,
        block_size,
        num_blocks * block_size,
        num_blocks * block_bytes / 2**20,
        dtype,
    )
    runtime = settings.runtime
    workers = [
        ChildSpec(
            name=f"worker{rank}",
            entry="engine.actors.worker:WorkerActor",
            group="workers",
            config=msgspec.msgpack.encode(
                WorkerConfig(
                    model_path=model_path,
                    rank=rank,
                    world_size=tp,
                    dtype=dtype,
                    device=device,
                    block_size=block_size,
                    kv_cache_memory=num_blocks * block_bytes,
                    max_model_len=max_model_len,
                    seed=settings.model.seed,
                    num_threads=runtime.worker_threads or None,
                )
            ),
            heartbeat_interval=runtime.heartbeat_interval,
            heartbeat_timeout=runtime.heartbeat_timeout,
            ready_timeout=runtime.start_timeout,
        )
        for rank in range(tp)
    ]
    tokenizer_config = TokenizerConfig(model_path, max_model_len, config.vocab_size)
    detok_config = DetokenizerConfig(model_path)
    children = (
        *workers,
        ChildSpec(
            name="scheduler",
            entry="engine.actors.scheduler.actor:SchedulerActor",
            config=msgspec.msgpack.encode(scheduler),
            heartbeat_interval=runtime.heartbeat_interval,
            heartbeat_timeout=runtime.heartbeat_timeout,
            ready_timeout=runtime.start_timeout,
        ),
        ChildSpec(
            name="detokenizer",
            entry="engine.actors.detokenizer:DetokenizerActor",
            config=msgspec.msgpack.encode(detok_config),
            heartbeat_interval=runtime.heartbeat_interval,
            heartbeat_timeout=runtime.heartbeat_timeout,
            ready_timeout=runtime.start_timeout,
        ),
        ChildSpec(
            name="tokenizer",
            entry="engine.actors.tokenizer:TokenizerActor",
            config=msgspec.msgpack.encode(tokenizer_config),
            heartbeat_interval=runtime.heartbeat_interval,
            heartbeat_timeout=runtime.heartbeat_timeout,
            ready_timeout=runtime.start_timeout,
        ),
    )
    worker_names = tuple(worker.name for worker in workers)
    rings = (
        RingDecl(name="requests", writer=ROOT, readers=("tokenizer",), capacity=RING_BYTES),
        RingDecl(name="failures", writer="tokenizer", readers=(ROOT,), capacity=RING_BYTES),
        RingDecl(name="submit", writer="tokenizer", readers=("scheduler",), capacity=RING_BYTES),
        RingDecl(name="plan", writer="scheduler", readers=worker_names, capacity=RING_BYTES),
        RingDecl(name="results", writer="worker0", readers=("scheduler",), capacity=RING_BYTES),
        RingDecl(name="tokens", writer="scheduler", readers=("detokenizer",), capacity=RING_BYTES),
        RingDecl(name="stops", writer="detokenizer", readers=("scheduler",), capacity=RING_BYTES),
        RingDecl(name="outputs", writer="detokenizer", readers=(ROOT,), capacity=RING_BYTES),
        RingDecl(name="reports", writer="scheduler", readers=(ROOT,), capacity=RING_BYTES),
    )
    spec = SupervisorSpec(
        children=children,
        rings=rings,
        strategy=Strategy.ONE_FOR_ONE,
        max_restarts=runtime.restart_intensity,
        max_seconds=runtime.restart_period,
        log_level=runtime.log_level.upper(),
    )
    return EnginePlan(model_path, config, device, dtype, num_blocks, max_model_len, spec)
