"""Joining a tensor-parallel group, for a worker rank starting up.

Rank 0 serves torch.distributed's TCP store. On one host it binds a free port each time the
group (re)starts, and tells the other ranks over the `rendezvous` ring (renewed with the group,
like every ring of a restarted child), so a restarted group never meets its old port. Across
hosts the port is the operator's `--master-port` (replica i uses master_port + i).
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from engine.actors.configs import WorkerConfig
from engine.messages.parallel import Rendezvous
from engine.messages.ring_catalogue import RENDEZVOUS_RING
from engine.model.parallel.config import TensorParallelConfig
from engine.model.placement.policy import rank_device
from engine.runtime.actor import Actor

CONNECT_ATTEMPT_S = 2.0


async def join_group_of(actor: Actor, config: WorkerConfig) -> tuple[WorkerConfig, Any]:
    """Join this rank's group; (config with this rank's device and KV bytes, the group)."""
    import torch

    from engine.model.parallel.group import join_group, open_store, wait_for_ranks

    tp = config.tensor_parallel
    assert tp is not None
    device = _rank_device(config.device, tp.local_rank)
    if tp.rank == 0:
        store = await asyncio.to_thread(
            open_store, 0, tp.size, tp.master_addr, tp.master_port, tp.timeout_s
        )
        address, port = tp.master_addr, store.port
        if RENDEZVOUS_RING.name in actor.rings.outbound_names:
            await actor.send_to(RENDEZVOUS_RING, Rendezvous(address, port))
        # Ranks on other hosts size their KV cache as the root did for this one.
        store.set("kv_cache_memory", str(config.kv_cache_memory))
    else:
        address, port = tp.master_addr, tp.master_port
        if port == 0:
            address, port = await _rendezvous_from_rank0(actor, tp)
        store = await _connect(tp, address, port)
        kv_bytes = int(store.get("kv_cache_memory"))
        config = msgspec.structs.replace(config, kv_cache_memory=kv_bytes)
    where = f"{address}:{port}"
    await asyncio.to_thread(wait_for_ranks, store, tp.size, tp.timeout_s, where)
    group = await asyncio.to_thread(
        join_group,
        store,
        tp.rank,
        tp.size,
        torch.device(device),
        tp.collective_timeout_s,
        tp.relay_plans,
    )
    actor.log.info("tensor-parallel rank %d of %d on %s", tp.rank, tp.size, device)
    return msgspec.structs.replace(config, device=device), group


def _rank_device(device: str, local_rank: int) -> str:
    """This rank's device: on CUDA the GPU of its index on the host (placement.rank_device)."""
    import torch

    count = torch.cuda.device_count() if device == "cuda" else 0
    return rank_device(device, local_rank, count)


async def _connect(tp: TensorParallelConfig, address: str, port: int) -> Any:
    """Rank 0's store, tried in short attempts (a stop request gets through between them)
    until it answers or tp.timeout_s has passed."""
    from engine.model.parallel.group import open_store

    loop = asyncio.get_running_loop()
    deadline = loop.time() + tp.timeout_s
    while True:
        attempt = min(CONNECT_ATTEMPT_S, max(deadline - loop.time(), 0.1))
        try:
            return await asyncio.to_thread(open_store, tp.rank, tp.size, address, port, attempt)
        except (RuntimeError, TimeoutError) as exc:  # torch says "timed out" as RuntimeError
            if loop.time() >= deadline:
                raise TimeoutError(
                    f"tensor-parallel rank {tp.rank}: no TCP store of rank 0 at {address}:{port} "
                    f"within {tp.timeout_s:g} s ({exc})"
                ) from None


async def _rendezvous_from_rank0(actor: Actor, tp: TensorParallelConfig) -> tuple[str, int]:
    reader = actor.rings.reader(RENDEZVOUS_RING.name)
    try:
        frames = await asyncio.wait_for(reader.recv_many(), tp.timeout_s)
    except TimeoutError:
        raise TimeoutError(
            f"tensor-parallel rank {tp.rank}: rank 0 announced no rendezvous port within "
            f"{tp.timeout_s:g} s"
        ) from None
    found = RENDEZVOUS_RING.decode(frames[-1])
    return found.master_addr, found.master_port
