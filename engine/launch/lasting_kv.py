"""The plan's part that lets the KV cache outlive the processes that use it.

On the CPU every worker rank keeps its KV cache in a segment of the run (`SegmentDecl`, the same
`kv-cache<rank>` a P/D rank's kv_transfer actor maps), owned by the root: a restarted worker maps
the blocks its predecessor wrote, and the scheduler keeps its prefix cache across the restart.
The scheduler mirrors its prefix-cache index in a small segment of its own
(engine/kv/cache/prefix_index.py), so that a restarted scheduler knows which blocks hold which
prefixes. Either way the requests resubmitted after a restart find their KV and compute only
the tokens past their last full block.

On a GPU the KV cache lives in the device's memory and dies with its worker; across hosts the
other nodes' ranks size their cache from rank 0's store. Both keep their own memory, and a
restart recomputes from scratch. This module never imports torch.
"""

from __future__ import annotations

import msgspec

from engine.kv.cache.prefix_index import prefix_index_bytes
from engine.launch.pd_plan import cache_segment, kv_layout
from engine.model.config import ModelConfig
from engine.model.parallel.config import Placement
from engine.model.placement.policy import device_type
from engine.runtime.child_spec import SegmentDecl
from engine.scheduler.config import SchedulerConfig

PREFIX_INDEX_SEGMENT = "prefix-index"


def kv_outlives_workers(device: str, placement: Placement) -> bool:
    """Whether the KV cache can live in the run's segments: on the CPU of one host."""
    return device_type(device) == "cpu" and placement.nnodes == 1


def lasting_kv_scheduler(scheduler: SchedulerConfig) -> SchedulerConfig:
    """The scheduler's config, told that its KV outlives the workers, and its index segment."""
    return msgspec.structs.replace(
        scheduler, kv_outlives_workers=True, prefix_index_segment=PREFIX_INDEX_SEGMENT
    )


def lasting_kv_segments(
    scheduler: SchedulerConfig,
    scheduler_name: str,
    config: ModelConfig,
    kv_dtype: str,
    workers: list[str],
    caches: bool = True,
) -> list[SegmentDecl]:
    """The prefix index's segment and, with `caches`, each rank's KV cache segment (of
    `kv_dtype`)."""
    segments = [
        SegmentDecl(
            name=PREFIX_INDEX_SEGMENT,
            size=prefix_index_bytes(scheduler.num_blocks),
            parties=(scheduler_name,),
        )
    ]
    tp = len(workers)
    for rank, worker in enumerate(workers if caches else []):
        layout = kv_layout(config, kv_dtype, scheduler.block_size, scheduler.num_blocks, tp, rank)
        segments.append(
            SegmentDecl(name=cache_segment(rank), size=layout.segment_bytes, parties=(worker,))
        )
    return segments
