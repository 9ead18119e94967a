"""From Settings to the actor system: which children, which rings, how big the KV cache is.

The root decides the KV cache's size in blocks once, here, and hands the same number to the
scheduler (which allocates blocks) and, as bytes, to the worker ranks (which allocate tensors);
each rank checks it arrived at the same count. Under tensor parallelism a block's bytes are one
rank's (its KV heads only), and every rank holds that many blocks of its own heads.

Data parallelism: each of the M replicas is a whole pipeline (tokenizer, scheduler, detokenizer
and its TP group of worker ranks) under a supervisor of its own; engine/inflight/replicas.py puts
them behind the one gateway. With M = 1 the one spec is the engine as it always was.

Across hosts (nnodes > 1), node 0 runs everything above plus its share of every replica's ranks
(rank 0 among them); node k > 0 runs only its ranks (`plan_worker_node`), which join rank 0's
group at master_addr:master_port (+ replica index) and get each step's plan relayed by rank 0.

This module never imports torch: the root process only reads config.json.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TypedDict

import msgspec

from engine.actors.configs import DetokenizerConfig, TokenizerConfig, WorkerConfig
from engine.actors.roles import Role
from engine.launch.draft import DraftFootprint, draft_footprint, draft_worker_fields
from engine.launch.kv_disk_plan import kv_disk_config, with_disk_party
from engine.launch.lasting_kv import (
    kv_outlives_workers,
    lasting_kv_scheduler,
    lasting_kv_segments,
)
from engine.launch.lora import lora_worker_fields
from engine.launch.pd_plan import kv_transfer_parts, replica_roles
from engine.launch.ranks import replica_suffix, supervisor_spec, worker_specs
from engine.launch.sizing import (
    check_parallel,
    check_pd_device,
    kernel_backend_of,
    kv_cache_blocks,
    log_memory,
    max_model_len_of,
    scheduler_config,
    thread_fields,
    threads_per_rank,
)
from engine.messages.ring_catalogue import (
    OUTPUTS_RING,
    PLAN_RING,
    PROMPTS_RING,
    RENDEZVOUS_RING,
    REPORTS_RING,
    REQUESTS_RING,
    RESULTS_RING,
    STOPS_RING,
    SUBMIT_RING,
    TOKENS_RING,
)
from engine.model.config import ModelConfig, load_model_config
from engine.model.parallel.config import Placement
from engine.model.placement.capacity import kv_block_bytes
from engine.model.placement.policy import (
    device_type,
    dtype_note,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
    weight_bytes_by_format,
)
from engine.model.quantized.formats import WeightFormat, quantized_bytes, quantized_formats
from engine.runtime.child_spec import (
    ROOT,
    ChildSpec,
    RingDecl,
    SegmentDecl,
    SupervisorSpec,
    declare_ring,
)
from engine.scheduler.config import SchedulerConfig
from engine.settings import Settings, resolve_home

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnginePlan:
    model_path: str
    model_config: ModelConfig
    device: str
    dtype: str
    num_blocks: int  # per replica (and per rank: each rank holds its heads of every block)
    max_model_len: int
    spec: SupervisorSpec  # replica 0's (the whole engine's when data_parallel_size is 1)
    replica_specs: tuple[SupervisorSpec, ...] = ()
    replica_roles: tuple[str, ...] = ()  # "both" | "prefill" | "decode" per replica (P/D)
    # Resident bytes of one rank's weights by what they are ("Q4_1", "float32"): /metrics
    weight_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    kv_bytes_per_rank: int = 0

    def __post_init__(self) -> None:
        if not self.replica_specs:
            object.__setattr__(self, "replica_specs", (self.spec,))
        if not self.replica_roles:
            object.__setattr__(self, "replica_roles", ("both",) * len(self.replica_specs))


class ChildTiming(TypedDict):
    heartbeat_interval: float
    heartbeat_timeout: float
    stall_timeout: float
    stopped_timeout: float
    ready_timeout: float


def plan_engine(
    settings: Settings, model_path: str, available_memory: int | None = None
) -> EnginePlan:
    """The engine's children, rings and sizes; `available_memory`: the bytes to size the KV
    cache from (None: the machine's free memory)."""
    config = load_model_config(model_path)
    placement = check_parallel(settings, config)
    device = resolve_device(settings.model.device)
    dtype = resolve_dtype(settings.model.dtype, config.torch_dtype, device)
    block_size = settings.cache.block_size
    tp = settings.parallel.tensor_parallel_size
    quantized = _weight_formats(settings, model_path, config, device)
    draft = draft_worker_fields(settings, model_path, config)
    footprint = draft_footprint(draft["draft_model_path"], block_size, dtype, device)
    kv_dtype, block_bytes, num_blocks = _kv_cache_sizes(
        settings, config, placement, quantized, footprint, available_memory
    )
    max_model_len = max_model_len_of(settings, config, num_blocks * block_size)
    scheduler = scheduler_config(settings, config, num_blocks, max_model_len)
    if kv_outlives_workers(device, placement):  # the disk tier reads and writes those segments
        disk = kv_disk_config(settings, model_path, config, dtype, kv_dtype, num_blocks)
        scheduler = msgspec.structs.replace(scheduler, kv_disk=disk)
    weights = _resident_weights(config, dtype, tp, device, quantized)
    note = dtype_note(settings.model.dtype, config.torch_dtype, dtype, device, bool(quantized))
    log.info("%s", note)
    log_memory(settings, placement, weights, num_blocks, block_bytes, kv_dtype, footprint)
    worker = WorkerConfig(
        model_path=model_path,
        rank=0,
        world_size=tp,
        dtype=dtype,
        device=device,
        block_size=block_size,
        kv_cache_memory=num_blocks * block_bytes,
        kv_cache_dtype=kv_dtype,
        max_model_len=max_model_len,
        **thread_fields(threads_per_rank(settings, device, placement)),
        kernel_backend=kernel_backend_of(settings),
        quantization=settings.model.quantization,
        engine_home=str(resolve_home(settings)),
        **draft,
        **lora_worker_fields(settings, config),
    )
    roles = replica_roles(settings)
    check_pd_device(roles, device)
    specs = tuple(
        _replica_spec(settings, placement, replica, worker, scheduler, config, role)
        for replica, role in enumerate(roles)
    )
    return EnginePlan(
        model_path,
        config,
        device,
        dtype,
        num_blocks,
        max_model_len,
        specs[0],
        specs,
        roles,
        weights,
        num_blocks * block_bytes,
    )


def _weight_formats(
    settings: Settings, model_path: str, config: ModelConfig, device: str
) -> dict[str, WeightFormat]:
    """The parameters held in a block format (engine/model/quantized/formats.py), by name."""
    return quantized_formats(
        model_path,
        config,
        settings.model.quantization,
        tensor_parallel_size=settings.parallel.tensor_parallel_size,
        on_cpu=device_type(device) == "cpu",
    )


def _resident_weights(
    config: ModelConfig, dtype: str, tp: int, device: str, quantized: dict[str, WeightFormat]
) -> dict[str, int]:
    """One rank's weight bytes by format ("Q4_1", "float32"), as /metrics shows them."""
    sizes = quantized_bytes(quantized, config)
    by_name = {name: (f.source, sizes[name]) for name, f in quantized.items()}
    return weight_bytes_by_format(config, dtype, tp, device, by_name)


def _kv_cache_sizes(
    settings: Settings,
    config: ModelConfig,
    placement: Placement,
    quantized: dict[str, WeightFormat],
    footprint: DraftFootprint | None,
    available_memory: int | None,
) -> tuple[str, int, int]:
    """The KV cache's element type, bytes per block and number of blocks per rank."""
    device = resolve_device(settings.model.device)
    dtype = resolve_dtype(settings.model.dtype, config.torch_dtype, device)
    kv_dtype = resolve_kv_cache_dtype(
        settings.cache.kv_cache_dtype, dtype, device, kernel_backend_of(settings), bool(quantized)
    )
    tp = settings.parallel.tensor_parallel_size
    block_bytes = kv_block_bytes(config, settings.cache.block_size, kv_dtype, tp)
    num_blocks = kv_cache_blocks(
        settings,
        config,
        device,
        dtype,
        kv_dtype,
        placement.local_ranks,
        quantized,
        footprint,
        available_memory,
    )
    return kv_dtype, block_bytes, num_blocks


def _replica_spec(
    settings: Settings,
    placement: Placement,
    replica: int,
    worker: WorkerConfig,
    scheduler: SchedulerConfig,
    config: ModelConfig,
    role: str = "both",
) -> SupervisorSpec:
    num_replicas = len(replica_roles(settings))
    suffix = replica_suffix(replica, num_replicas)
    moves_kv = role != "both"
    keeps_kv = kv_outlives_workers(worker.device, placement)
    workers = worker_specs(settings, placement, replica, worker, moves_kv or keeps_kv)
    if moves_kv:
        scheduler = msgspec.structs.replace(
            scheduler,
            kv_transfer_ranks=len(workers),
            kv_hold_timeout=settings.kv_transfer.hold_timeout,
        )
    if keeps_kv:
        scheduler = lasting_kv_scheduler(scheduler)
    pipeline = _pipeline_specs(settings, config, worker, scheduler, suffix)
    children: tuple[ChildSpec, ...] = (*workers, *pipeline)
    sched, detok, tokenizer = (child.name for child in pipeline)
    rings = _pipeline_rings(settings, placement, [w.name for w in workers], sched, detok, tokenizer)
    segments: list[SegmentDecl] = []
    if keeps_kv:  # P/D declares the caches' segments below, with their kv_transfer actors
        segments = lasting_kv_segments(
            scheduler,
            sched,
            config,
            worker.kv_cache_dtype,
            [w.name for w in workers],
            caches=not moves_kv,
        )
    if moves_kv:
        transfers, kv_rings, cache_segments = kv_transfer_parts(
            settings,
            config,
            worker.kv_cache_dtype,
            worker.block_size,
            scheduler.num_blocks,
            replica,
            suffix,
            sched,
            [w.name for w in workers],
        )
        children = (*children, *transfers)
        rings += kv_rings
        segments += cache_segments
    if scheduler.kv_disk is not None:
        segments = with_disk_party(segments, sched)
    return supervisor_spec(settings, children, tuple(rings), tuple(segments))


def _pipeline_specs(
    settings: Settings,
    config: ModelConfig,
    worker: WorkerConfig,
    scheduler: SchedulerConfig,
    suffix: str,
) -> tuple[ChildSpec, ChildSpec, ChildSpec]:
    """A replica's scheduler, detokenizer and tokenizer."""
    runtime = settings.runtime
    timing: ChildTiming = {
        "heartbeat_interval": runtime.heartbeat_interval,
        "heartbeat_timeout": runtime.heartbeat_timeout,
        "stall_timeout": runtime.stall_timeout,
        "stopped_timeout": runtime.stopped_timeout,
        "ready_timeout": runtime.start_timeout,
    }
    tokenizer_config = TokenizerConfig(
        worker.model_path,
        worker.max_model_len,
        config.vocab_size,
        settings.server.allow_special_tokens_in_chat,
        worker.max_model_len * settings.limits.max_prompt_chars_per_token,
        settings.limits.template_cpu_seconds,
    )
    return (
        ChildSpec(
            name=f"scheduler{suffix}",
            entry="engine.actors.scheduler:SchedulerActor",
            role=Role.SCHEDULER,
            config=msgspec.msgpack.encode(scheduler),
            **timing,
        ),
        ChildSpec(
            name=f"detokenizer{suffix}",
            entry="engine.actors.detokenizer:DetokenizerActor",
            role=Role.DETOKENIZER,
            config=msgspec.msgpack.encode(DetokenizerConfig(worker.model_path)),
            **timing,
        ),
        ChildSpec(
            name=f"tokenizer{suffix}",
            entry="engine.actors.tokenizer:TokenizerActor",
            role=Role.TOKENIZER,
            config=msgspec.msgpack.encode(tokenizer_config),
            **timing,
        ),
    )


def _pipeline_rings(
    settings: Settings,
    placement: Placement,
    workers: list[str],
    sched: str,
    detok: str,
    tokenizer: str,
) -> list[RingDecl]:
    """The rings between a replica's actors and the root."""
    rank0 = workers[0]
    # Across hosts only rank 0 reads the plan ring; it relays each plan to the others.
    plan_readers = (rank0,) if placement.nnodes > 1 else tuple(workers)
    rings = [
        declare_ring(REQUESTS_RING, ROOT, [tokenizer]),
        declare_ring(SUBMIT_RING, tokenizer, [sched]),
        declare_ring(PROMPTS_RING, tokenizer, [ROOT]),
        declare_ring(PLAN_RING, sched, plan_readers),
        declare_ring(RESULTS_RING, rank0, [sched]),
        declare_ring(TOKENS_RING, sched, [detok]),
        declare_ring(STOPS_RING, detok, [sched]),
        declare_ring(OUTPUTS_RING, detok, [ROOT]),
        declare_ring(REPORTS_RING, sched, [ROOT]),
    ]
    if len(workers) > 1 and settings.parallel.master_port == 0:
        # Rank 0 tells the other ranks of this host the port it bound (fresh at each restart).
        rings.append(declare_ring(RENDEZVOUS_RING, rank0, workers[1:]))
    return rings
