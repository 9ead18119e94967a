"""What a worker rank is started with (encoded into its ChildSpec by the plan)."""

from __future__ import annotations

import msgspec

from engine.model.parallel.config import TensorParallelConfig


class WorkerConfig(msgspec.Struct, frozen=True):
    model_path: str
    rank: int
    world_size: int
    dtype: str
    device: str
    block_size: int
    kv_cache_memory: int  # bytes; the root sized it to exactly the scheduler's block count
    max_model_len: int
    num_threads: int | None = None  # torch threads for small steps (placement.ThreadPolicy)
    busy_threads: int | None = None  # for large steps (placement.ThreadPolicy.threads_for)
    kernel_backend: str = "auto"
    quantization: str = "auto"  # model.quantization (engine/model/quantized_formats.py)
    engine_home: str = ""  # runtime.engine_home, where the CPU kernel is built; "": $ENGINE_HOME
    tensor_parallel: TensorParallelConfig | None = None  # None: a group of one
    # P/D: the SegmentDecl its KV cache lives in (its kv_transfer actor maps it too); "": none.
    kv_cache_segment: str = ""
