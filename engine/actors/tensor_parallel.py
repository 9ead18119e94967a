"""Worker ranks of a tensor-parallel group: joining the group, and the plan relay across hosts.

Joining (`join_group_of`, called from WorkerActor.on_start): rank 0 serves torch.distributed's
TCP store. On one host it binds a free port each time the group (re)starts, and tells the other
ranks over the `rendezvous` ring (renewed with the group, like every ring of a restarted child),
so a restarted group never meets its old port. Across hosts the port is the operator's
`--master-port` (replica i uses master_port + i).

Plans across hosts: shared-memory rings do not leave a host, so a rank on another host cannot
read the plan ring. In a group that spans hosts only rank 0 reads it (`PlanRelayWorker`); before
running each plan it broadcasts the encoded plan over the group, and every other rank
(`PlanFollowerWorker`) receives it there and runs it: the same plans, in the same order, with
the same sequence resets, so the ranks' collectives line up.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from engine.actors.runtime.actor import Actor
from engine.actors.worker import WorkerActor, WorkerConfig
from engine.messages.parallel import RELAYED_PLANS, RENDEZVOUS, RelayedPlan, Rendezvous
from engine.messages.steps import StepPlan, StepResult, WorkerFailed
from engine.model.parallel.config import TensorParallelConfig

RENDEZVOUS_RING = "rendezvous"
RELAY_TOKENS_IN_THREAD = 512  # as the worker: long steps leave the event loop free
CONNECT_ATTEMPT_S = 2.0


async def join_group_of(actor: Actor, config: WorkerConfig) -> tuple[WorkerConfig, Any]:
    """Join this rank's group; (config with this rank's device and KV bytes, the group)."""
    import torch

    from engine.model.parallel.group import join_group, open_store, wait_for_ranks

    tp = config.tensor_parallel
    assert tp is not None
    device = rank_device(config.device, tp.local_rank)
    if tp.rank == 0:
        store = await asyncio.to_thread(
            open_store, 0, tp.size, tp.master_addr, tp.master_port, tp.timeout_s
        )
        address, port = tp.master_addr, store.port
        if RENDEZVOUS_RING in actor.rings.outbound_names:
            await actor.send(RENDEZVOUS_RING, RENDEZVOUS.encode(Rendezvous(address, port)))
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
    group = await asyncio.to_thread(join_group, store, tp.rank, tp.size, torch.device(device))
    actor.log.info("tensor-parallel rank %d of %d on %s", tp.rank, tp.size, device)
    return msgspec.structs.replace(config, device=device), group


def rank_device(device: str, local_rank: int) -> str:
    """A CUDA rank takes the GPU of its index on the host; "cuda:N" and CPU stay as given."""
    if device in ("cuda", "auto"):
        import torch

        if torch.cuda.is_available():
            return f"cuda:{local_rank % torch.cuda.device_count()}"
        return "cpu"
    return device


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
    reader = actor.rings.reader(RENDEZVOUS_RING)
    try:
        frames = await asyncio.wait_for(reader.recv_many(), tp.timeout_s)
    except TimeoutError:
        raise TimeoutError(
            f"tensor-parallel rank {tp.rank}: rank 0 announced no rendezvous port within "
            f"{tp.timeout_s:g} s"
        ) from None
    found = RENDEZVOUS.decode(frames[-1])
    return found.master_addr, found.master_port


class PlanRelayWorker(WorkerActor):
    """Rank 0 of a group that spans hosts: broadcasts each plan to the group, then runs it."""

    def run_step(self, plan: StepPlan) -> list[StepResult | WorkerFailed]:
        relayed = RelayedPlan(self._sequences_generation, plan)
        self.runner.group.broadcast_frames([RELAYED_PLANS.encode(relayed)])
        return super().run_step(plan)


class PlanFollowerWorker(WorkerActor):
    """A rank > 0 of a group that spans hosts: runs the plans rank 0 broadcasts.

    It reads no ring; waiting for the next plan happens in a thread, so heartbeats and control
    messages go on while the engine is idle. When rank 0 goes away the broadcast fails and the
    follower stops, to be restarted by its own supervisor and join rank 0's next generation.
    """

    async def on_start(self) -> dict[str, Any] | None:
        info = await super().on_start()
        self._following = asyncio.get_running_loop().create_task(self._follow())
        self._following.add_done_callback(self._on_follow_done)
        return info

    async def on_stop(self) -> None:
        self._following.cancel()
        await super().on_stop()

    async def _follow(self) -> None:
        group = self.runner.group
        while True:
            [frame] = await asyncio.to_thread(group.receive_frames)
            relayed = RELAYED_PLANS.decode(frame)
            if relayed.sequences_generation != self._sequences_generation:
                self._new_sampler()  # rank 0 met a restarted scheduler: sequences start over
                self._sequences_generation = relayed.sequences_generation
            plan = relayed.plan
            if sum(len(chunk.token_ids) for chunk in plan.chunks) > RELAY_TOKENS_IN_THREAD:
                await asyncio.to_thread(self.run_step, plan)
            else:
                self.run_step(plan)

    def _on_follow_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled():
            error = task.exception()
            self.log.error("plan relay from rank 0 ended: %r", error)
            self.stop(f"plan relay from rank 0 ended: {error!r}")
