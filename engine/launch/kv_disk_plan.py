"""The plan's part for the prefix cache's disk tier (engine/kv/disk/): where it lives, the
namespace of this engine's blocks, and the scheduler's access to the ranks' cache segments.

The tier needs the KV cache in segments of the run (the CPU, one host: engine/launch/
lasting_kv.py): the scheduler's process maps them and moves blocks between them and their files
on a thread. Its directory is made (or checked) here, in the root, so that a path nobody may use
stops the start with one line naming the setting rather than failing in a child. This module never
imports torch.
"""

from __future__ import annotations

import os

import msgspec

from engine.kv.disk.config import KvDiskConfig
from engine.kv.disk.namespace import describe, model_digest, namespace_of
from engine.launch.pd_plan import cache_segment, kv_layout
from engine.launch.sizing import kernel_backend_of
from engine.model.config import ModelConfig
from engine.runtime.child_spec import SegmentDecl
from engine.runtime.private_files import check_owned_tree
from engine.settings import Settings, resolve_home

TIER_DIRECTORY = "kv-disk"  # in the engine home, unless cache.kv_disk_path names one


def kv_disk_path(settings: Settings) -> str:
    return settings.cache.kv_disk_path or os.path.join(resolve_home(settings), TIER_DIRECTORY)


def kv_disk_config(
    settings: Settings,
    model_path: str,
    config: ModelConfig,
    dtype: str,
    kv_dtype: str,
    num_blocks: int,
) -> KvDiskConfig | None:
    """The tier's config for one replica's scheduler; None when it is off. ValueError (naming
    the setting) when its directory cannot be ours."""
    cache = settings.cache
    if not cache.kv_disk or not cache.enable_prefix_caching:
        return None
    path = os.path.abspath(os.path.expanduser(kv_disk_path(settings)))
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        check_owned_tree(path)
    except OSError as exc:
        raise ValueError(f"cache.kv_disk_path: {exc} (or --no-kv-disk)") from None
    tp = settings.parallel.tensor_parallel_size
    layouts = [kv_layout(config, kv_dtype, cache.block_size, num_blocks, tp, r) for r in range(tp)]
    quantization, kernels = settings.model.quantization, kernel_backend_of(settings)
    description = describe(model_digest(model_path), dtype, quantization, kernels, layouts)
    return KvDiskConfig(
        path=path,
        max_bytes=cache.kv_disk_size,
        namespace=namespace_of(description).hex(),
        description=description,
        layouts=layouts,
        cache_segments=[cache_segment(rank) for rank in range(tp)],
    )


def with_disk_party(segments: list[SegmentDecl], scheduler: str) -> list[SegmentDecl]:
    """The cache segments, mapped by the scheduler too (its disk tier's thread)."""
    caches = {cache_segment(rank) for rank in range(len(segments))}
    return [
        msgspec.structs.replace(decl, parties=(*decl.parties, scheduler))
        if decl.name in caches
        else decl
        for decl in segments
    ]
