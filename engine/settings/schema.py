"""The settings schema: one msgspec Struct per section, every field typed, bounded and described.

Bounds live in each field's `Meta` so that validation (msgspec) and the error message (which
names the allowed range) come from the same place. Keep this module torch-free: every process
imports it.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

# A byte count; in TOML, env and flags it may also be written "512MiB", "4GB", "1.5GiB".
BYTES_UNIT = {"unit": "bytes"}

Dtype = Literal["auto", "float32", "float16", "bfloat16"]
Device = Literal["auto", "cpu", "cuda"]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class ModelSettings(_Section, frozen=True):
    path: Annotated[
        str | None,
        Meta(description="checkpoint directory (HF layout); unset = the built-in demo model"),
    ] = None
    served_name: Annotated[
        str | None,
        Meta(description="model name clients send and see; unset = derived from the path"),
    ] = None
    dtype: Annotated[
        Dtype, Meta(description="weight/activation dtype; auto = checkpoint's (float32 on CPU)")
    ] = "auto"
    device: Annotated[Device, Meta(description="where the model runs; auto = cuda if present")] = (
        "auto"
    )
    max_model_len: (
        Annotated[
            int, Meta(ge=1, description="max prompt + output tokens per request; unset = model's")
        ]
        | None
    ) = None
    seed: Annotated[
        int, Meta(ge=0, description="base seed for requests that do not set their own")
    ] = 0


class CacheSettings(_Section, frozen=True):
    block_size: Annotated[int, Meta(ge=1, le=1024, description="tokens per KV cache block")] = 16
    kv_cache_memory: (
        Annotated[
            int,
            Meta(
                ge=1,
                description="bytes for the KV cache (e.g. 2GiB); unset = use kv_cache_fraction",
                extra=BYTES_UNIT,
            ),
        ]
        | None
    ) = None
    kv_cache_fraction: Annotated[
        float,
        Meta(gt=0.0, le=1.0, description="fraction of device memory for weights + KV cache"),
    ] = 0.9
    enable_prefix_caching: Annotated[
        bool, Meta(description="reuse KV blocks of identical prompt prefixes")
    ] = True


class SchedulerSettings(_Section, frozen=True):
    max_num_seqs: Annotated[int, Meta(ge=1, description="most sequences running in one batch")] = (
        256
    )
    # vLLM-CPU's server default. A step's prefill tokens hold up every running decode: at 8192,
    # 128 streams saw inter-token p99 855 ms under a burst of prompts, at 2048 298 ms, for the
    # same throughput (demo model, 2 cores).
    max_num_batched_tokens: Annotated[
        int, Meta(ge=1, description="most tokens in one step (longer prefills are chunked)")
    ] = 2048
    max_queued_requests: Annotated[
        int, Meta(ge=1, description="waiting requests beyond which new ones get 429")
    ] = 1024


class ParallelSettings(_Section, frozen=True):
    tensor_parallel_size: Annotated[
        int, Meta(ge=1, le=64, description="worker ranks sharing one model replica")
    ] = 1
    data_parallel_size: Annotated[
        int, Meta(ge=1, le=64, description="independent model replicas")
    ] = 1
    nnodes: Annotated[
        int, Meta(ge=1, le=64, description="hosts the worker ranks span (one launch per host)")
    ] = 1
    node_rank: Annotated[
        int,
        Meta(ge=0, le=63, description="this host's index; 0 serves the API, others run ranks"),
    ] = 0
    master_addr: Annotated[
        str,
        Meta(min_length=1, description="address of node 0, where rank 0's TCP store listens"),
    ] = "127.0.0.1"
    master_port: Annotated[
        int,
        Meta(
            ge=0,
            le=65535,
            description="rank 0's TCP store port (replica i: +i); 0 = a free one (one host only)",
        ),
    ] = 0


class ServerSettings(_Section, frozen=True):
    host: Annotated[str, Meta(min_length=1, description="address the HTTP server binds")] = (
        "127.0.0.1"
    )
    port: Annotated[
        int, Meta(ge=0, le=65535, description="HTTP port; 0 = any free port (printed at start)")
    ] = 8000
    api_key: Annotated[
        str | None,
        Meta(description="require 'Authorization: Bearer KEY' (also env ENGINE_API_KEY)"),
    ] = None
    max_request_bytes: Annotated[
        int, Meta(ge=1, description="largest request body accepted (bigger: 413)", extra=BYTES_UNIT)
    ] = 4 * 1024 * 1024
    drain_timeout: Annotated[
        float, Meta(ge=0.0, description="seconds in-flight requests get to finish on shutdown")
    ] = 30.0
    record_trace: Annotated[
        str | None,
        Meta(description="append each request's arrival, sizes and timings to this .jsonl file"),
    ] = None
    header_timeout: Annotated[
        float,
        Meta(
            gt=0.0,
            description="seconds a connection gets to send a complete request head; then "
            "it is answered 408 and closed",
        ),
    ] = 10.0
    max_connections: Annotated[
        int,
        Meta(ge=1, description="open HTTP connections; one more is answered 503 and closed"),
    ] = 2048


class AdminSettings(_Section, frozen=True):
    socket: Annotated[
        str | None,
        Meta(description="admin Unix socket path; unset = <runtime dir>/engine-<pid>/admin.sock"),
    ] = None


class RuntimeSettings(_Section, frozen=True):
    engine_home: Annotated[
        str,
        Meta(min_length=1, description="directory for the engine's own files (also ENGINE_HOME)"),
    ] = "~/.cache/engine"
    log_level: Annotated[LogLevel, Meta(description="log verbosity of every process")] = "info"
    heartbeat_interval: Annotated[
        float, Meta(gt=0.0, description="seconds between an actor's heartbeats")
    ] = 1.0
    heartbeat_timeout: Annotated[
        float,
        Meta(gt=0.0, description="seconds without a heartbeat before an actor counts as hung"),
    ] = 10.0
    start_timeout: Annotated[
        float, Meta(gt=0.0, description="seconds each actor gets to report ready at start")
    ] = 300.0
    restart_intensity: Annotated[
        int, Meta(ge=0, description="restarts allowed within restart_period before shutdown")
    ] = 5
    restart_period: Annotated[
        float, Meta(gt=0.0, description="window (seconds) in which restart_intensity counts")
    ] = 60.0
    worker_threads: Annotated[
        int,
        Meta(ge=0, le=1024, description="torch threads per CPU worker rank; 0 = cores - 1"),
    ] = 0
    quarantine_after: Annotated[
        int,
        Meta(ge=1, description="crashes a request may be part of before it is failed, not retried"),
    ] = 2


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: ModelSettings = msgspec.field(default_factory=ModelSettings)
    cache: CacheSettings = msgspec.field(default_factory=CacheSettings)
    scheduler: SchedulerSettings = msgspec.field(default_factory=SchedulerSettings)
    parallel: ParallelSettings = msgspec.field(default_factory=ParallelSettings)
    server: ServerSettings = msgspec.field(default_factory=ServerSettings)
    admin: AdminSettings = msgspec.field(default_factory=AdminSettings)
    runtime: RuntimeSettings = msgspec.field(default_factory=RuntimeSettings)


SECTIONS: dict[str, type[_Section]] = {
    "model": ModelSettings,
    "cache": CacheSettings,
    "scheduler": SchedulerSettings,
    "parallel": ParallelSettings,
    "server": ServerSettings,
    "admin": AdminSettings,
    "runtime": RuntimeSettings,
}
