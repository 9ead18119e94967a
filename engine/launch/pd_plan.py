"""The plan's part for P/D (prefill/decode disaggregation): which replicas prefill, which
decode, and the actors, rings and segments a replica with KV transfer gets.

A replica with a role other than `both` in a one-launch P/D engine, and the one replica of an
instance started with `--kv-role prefill|decode`, get one kv_transfer actor per worker rank.
Each rank's KV cache then lives in a segment of the run (`SegmentDecl`), mapped by the worker and
by its kv_transfer actor: the kv_transfer actor copies blocks in and out while the worker runs.
Every kv_transfer actor of an instance gets its deployment secret (engine/kv/transfer/secret.py:
one-launch P/D makes one for the run, so its replicas share it with no setup). This module never
imports torch.
"""

from __future__ import annotations

import msgspec

from engine.actors.configs import KvTransferConfig
from engine.actors.roles import Role
from engine.kv.transfer.secret import instance_secret
from engine.kv.transfer.tls import TlsFiles
from engine.messages.kv_transfer import KvLayout
from engine.messages.ring_catalogue import KV_EVENTS_RING, KV_ORDERS_RING
from engine.model.config import ModelConfig
from engine.model.parallel.layout import kv_heads_per_rank
from engine.model.placement.capacity import ROW_SCALE_BYTES, dtype_bytes
from engine.runtime.child_spec import ChildSpec, RingDecl, SegmentDecl, declare_ring
from engine.settings import Settings

KV_TRANSFER = "engine.actors.kv_transfer:KvTransferActor"


def replica_roles(settings: Settings) -> tuple[str, ...]:
    """Each replica's role: one-launch P/D lists prefill replicas first, then decode ones."""
    kv = settings.kv_transfer
    if kv.prefill_replicas and kv.decode_replicas:
        return ("prefill",) * kv.prefill_replicas + ("decode",) * kv.decode_replicas
    return (kv.role,) * settings.parallel.data_parallel_size


def kv_layout(
    config: ModelConfig, kv_dtype: str, block_size: int, num_blocks: int, tp: int, rank: int
) -> KvLayout:
    kv_heads = kv_heads_per_rank(config, tp)
    return KvLayout(
        model=(
            f"{config.architecture}/L{config.num_layers}/KV{config.num_kv_heads}"
            f"/D{config.head_dim}/V{config.vocab_size}"
        ),
        num_layers=config.num_layers,
        num_kv_heads=kv_heads,
        head_dim=config.head_dim,
        block_size=block_size,
        dtype=kv_dtype,
        itemsize=dtype_bytes(kv_dtype),
        scale_bytes=ROW_SCALE_BYTES.get(kv_dtype, 0),
        tp_size=tp,
        tp_rank=rank,
        num_blocks=num_blocks,
    )


def kv_transfer_parts(
    settings: Settings,
    config: ModelConfig,
    kv_dtype: str,
    block_size: int,
    num_blocks: int,
    replica: int,
    suffix: str,
    scheduler: str,
    workers: list[str],
) -> tuple[list[ChildSpec], list[RingDecl], list[SegmentDecl]]:
    """One replica's kv_transfer actors, their rings, and its ranks' cache segments (worker
    rank r's cache is segment f"kv-cache{r}"). With kv_transfer.port set, replica i's rank r
    listens on port + i * tp + r."""
    kv, runtime = settings.kv_transfer, settings.runtime
    tp = len(workers)
    secret = instance_secret(settings)  # one-launch P/D: the run's own, shared by its replicas
    tls = TlsFiles(kv.tls_cert or "", kv.tls_key or "", kv.tls_ca or "")
    children, rings, segments = [], [], []
    for rank, worker in enumerate(workers):
        name = f"kv_transfer{rank}{suffix}"
        layout = kv_layout(config, kv_dtype, block_size, num_blocks, tp, rank)
        transfer = KvTransferConfig(
            rank=rank,
            layout=layout,
            cache_segment=cache_segment(rank),
            listen_host=kv.host,
            port_base=kv.port + replica * tp if kv.port else 0,  # rank r: + r
            advertised_host=kv.advertise_host or "",
            force_tcp=kv.transport == "tcp",
            secret=secret,
            tls_cert=tls.cert,
            tls_key=tls.key,
            tls_ca=tls.ca,
        )
        children.append(
            ChildSpec(
                name=name,
                entry=KV_TRANSFER,
                role=Role.KV_TRANSFER,
                config=msgspec.msgpack.encode(transfer),
                heartbeat_interval=runtime.heartbeat_interval,
                heartbeat_timeout=runtime.heartbeat_timeout,
                stall_timeout=runtime.stall_timeout,
                stopped_timeout=runtime.stopped_timeout,
                ready_timeout=runtime.start_timeout,
            )
        )
        rings.append(declare_ring(KV_EVENTS_RING.at(rank), name, [scheduler]))
        segments.append(
            SegmentDecl(name=cache_segment(rank), size=layout.segment_bytes, parties=(worker, name))
        )
    names = tuple(child.name for child in children)
    rings.append(declare_ring(KV_ORDERS_RING, scheduler, names))
    return children, rings, segments


def cache_segment(rank: int) -> str:
    return f"kv-cache{rank}"
