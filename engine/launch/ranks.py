"""The worker ranks of a replica, as the supervisor starts them: this host's ranks of its group
(one `one_for_all` group: they restart together), and the whole plan of a host that runs only
ranks (node k > 0 of a multi-host topology). Torch-free, as plan.py."""

from __future__ import annotations

import msgspec

from engine.actors.configs import WorkerConfig
from engine.actors.roles import Role
from engine.launch.pd_plan import cache_segment, replica_roles
from engine.launch.sizing import (
    check_parallel,
    kernel_backend_of,
    max_model_len_of,
    thread_fields,
    threads_per_rank,
)
from engine.model.config import load_model_config
from engine.model.parallel.config import Placement, TensorParallelConfig
from engine.model.placement.policy import resolve_device, resolve_dtype
from engine.runtime.child_spec import ChildSpec, RingDecl, SegmentDecl, Strategy, SupervisorSpec
from engine.settings import Settings, resolve_home

WORKER = "engine.actors.worker:WorkerActor"
RELAY_WORKER = "engine.actors.tp_relay:PlanRelayWorker"
FOLLOWER_WORKER = "engine.actors.tp_relay:PlanFollowerWorker"


def replica_suffix(replica: int, data_parallel_size: int) -> str:
    """What tells replica i's actors apart ("-r1"); none with a single replica."""
    return f"-r{replica}" if data_parallel_size > 1 else ""


def plan_worker_node(settings: Settings, model_path: str) -> tuple[SupervisorSpec, ...]:
    """Node k > 0 of a multi-host topology: its ranks of every replica, one spec per replica.
    They read no ring: rank 0 (on node 0) relays each plan, and tells them its KV cache size."""
    config = load_model_config(model_path)
    placement = check_parallel(settings, config)
    if settings.parallel.node_rank == 0:
        raise ValueError("parallel.node_rank 0 serves the API: run it as the engine, not a node")
    device = resolve_device(settings.model.device)
    worker = WorkerConfig(
        model_path=model_path,
        rank=0,
        world_size=settings.parallel.tensor_parallel_size,
        dtype=resolve_dtype(settings.model.dtype, config.torch_dtype, device),
        device=device,
        block_size=settings.cache.block_size,
        kv_cache_memory=0,  # rank 0's value arrives over the group's store
        kv_cache_dtype=settings.cache.kv_cache_dtype,  # resolved alike by each worker
        max_model_len=max_model_len_of(settings, config),
        **thread_fields(threads_per_rank(settings, device, placement)),
        kernel_backend=kernel_backend_of(settings),
        quantization=settings.model.quantization,
        engine_home=str(resolve_home(settings)),
    )
    specs = []
    for replica in range(settings.parallel.data_parallel_size):
        workers = worker_specs(settings, placement, replica, worker)
        specs.append(supervisor_spec(settings, tuple(workers), ()))
    return tuple(specs)


def worker_specs(
    settings: Settings,
    placement: Placement,
    replica: int,
    worker: WorkerConfig,
    kv_in_segments: bool = False,
) -> list[ChildSpec]:
    """This host's ranks of one replica, one group (they restart together: one_for_all).
    `kv_in_segments`: each rank's KV cache lives in its segment of the run (lasting_kv.py)."""
    parallel = settings.parallel
    tp = parallel.tensor_parallel_size
    suffix = replica_suffix(replica, len(replica_roles(settings)))
    spans_hosts = placement.nnodes > 1
    port = parallel.master_port + replica if parallel.master_port else 0
    runtime = settings.runtime
    specs = []
    for local_rank, rank in enumerate(placement.ranks_on(parallel.node_rank)):
        group_config = None
        if tp > 1:
            group_config = TensorParallelConfig(
                rank=rank,
                size=tp,
                master_addr=parallel.master_addr,
                master_port=port,
                relay_plans=spans_hosts,
                local_rank=replica * placement.ranks_per_node + local_rank,
                timeout_s=runtime.start_timeout,
                collective_timeout_s=parallel.collective_timeout,
            )
        entry = WORKER
        if spans_hosts:
            entry = RELAY_WORKER if rank == 0 else FOLLOWER_WORKER
        config = msgspec.structs.replace(
            worker,
            rank=rank,
            tensor_parallel=group_config,
            kv_cache_segment=cache_segment(rank) if kv_in_segments else "",
        )
        specs.append(
            ChildSpec(
                name=f"worker{rank}{suffix}",
                entry=entry,
                role=Role.WORKER,
                group=f"workers{suffix}",
                config=msgspec.msgpack.encode(config),
                heartbeat_interval=runtime.heartbeat_interval,
                heartbeat_timeout=runtime.heartbeat_timeout,
                ready_timeout=runtime.start_timeout,
                stall_timeout=runtime.stall_timeout,
                stopped_timeout=runtime.stopped_timeout,
            )
        )
    return specs


def supervisor_spec(
    settings: Settings,
    children: tuple[ChildSpec, ...],
    rings: tuple[RingDecl, ...],
    segments: tuple[SegmentDecl, ...] = (),
) -> SupervisorSpec:
    runtime = settings.runtime
    return SupervisorSpec(
        children=children,
        rings=rings,
        segments=segments,
        strategy=Strategy.ONE_FOR_ONE,
        max_restarts=runtime.restart_intensity,
        max_seconds=runtime.restart_period,
        log_level=runtime.log_level.upper(),
        spares=runtime.spare_processes,
    )
