"""What a model takes in memory on this host: its weights and KV caches, every rank of every
replica; before it is started (the least it needs, for the loaded models' memory budget,
engine/catalogue/pool.py) and once planned."""

from __future__ import annotations

from engine.actors.roles import Role
from engine.launch.model_source import model_directory
from engine.launch.plan import EnginePlan, plan_engine
from engine.model.placement.capacity import kv_block_bytes
from engine.settings import Settings, resolve_home


def planned_memory_bytes(plan: EnginePlan) -> int:
    """The weights and KV caches of every worker rank a plan starts."""
    per_rank = sum(plan.weight_bytes.values()) + plan.kv_bytes_per_rank
    return per_rank * _worker_ranks(plan)


def least_memory_bytes(settings: Settings, room: int) -> int:
    """The least a model needs to serve one sequence of its context: its weights and the KV
    blocks of max_model_len tokens (all of cache.kv_cache_memory when that is set), planned as
    if `room` bytes were free."""
    model = settings.model
    path, _ = model_directory(model.path, resolve_home(settings), model.tokenizer)
    plan = plan_engine(settings, path, room)
    if settings.cache.kv_cache_memory is not None:
        kv = plan.kv_bytes_per_rank
    else:
        block_size = settings.cache.block_size
        tp = settings.parallel.tensor_parallel_size
        blocks = -(-plan.max_model_len // block_size)
        kv = blocks * kv_block_bytes(plan.model_config, block_size, plan.dtype, tp)
    return (sum(plan.weight_bytes.values()) + kv) * _worker_ranks(plan)


def _worker_ranks(plan: EnginePlan) -> int:
    ranks = sum(
        1 for spec in plan.replica_specs for child in spec.children if child.role == Role.WORKER
    )
    return max(ranks, 1)
