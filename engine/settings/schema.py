"""The settings schema: one msgspec Struct per section, every field typed, bounded and described.

Bounds live in each field's `Meta` so that validation (msgspec) and the error message (which
names the allowed range) come from the same place. Keep this module torch-free: every process
imports it.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from engine.settings.kv_transfer_schema import KvTransferSettings, kv_transfer_problems
from engine.settings.lora_schema import LoraSettings, lora_problems
from engine.settings.model_schema import ModelSettings, Quantization, model_problems
from engine.settings.models_schema import ModelsSettings, models_problems
from engine.settings.section import BYTES_UNIT
from engine.settings.section import Section as _Section
from engine.settings.server_schema import ServerSettings, server_problems

# re-exported: the schema's names live here
__all__ = [
    "BYTES_UNIT",
    "KvTransferSettings",
    "LoraSettings",
    "ModelSettings",
    "ModelsSettings",
    "Quantization",
    "ServerSettings",
]


KvCacheDtype = Literal["auto", "float32", "float16", "bfloat16", "int8"]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]


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
        Meta(
            gt=0.0,
            le=1.0,
            description="share of the memory available at start that the weights and the KV "
            "cache may take together (the KV cache gets what the weights leave; CPU: at most "
            "2 GiB per rank)",
        ),
    ] = 0.9
    enable_prefix_caching: Annotated[
        bool, Meta(description="reuse KV blocks of identical prompt prefixes")
    ] = True
    kv_cache_dtype: Annotated[
        KvCacheDtype,
        Meta(
            description="KV cache element type: float16 or bfloat16 (half the bytes of "
            "float32), int8 (a quarter, with a float32 scale per token and KV head) or float32; "
            "auto = the model's dtype, except float16 for quantized weights on the CPU (as "
            "llama.cpp's f16 cache); a GPU or the triton kernels take only the model's dtype"
        ),
    ] = "auto"
    kv_disk: Annotated[
        bool,
        Meta(
            description="keep the prefix cache's full KV blocks on disk too, where later "
            "requests find them after RAM eviction, a restart or a reload (CPU, one host; "
            "--no-kv-disk: off)"
        ),
    ] = True
    kv_disk_path: Annotated[
        str | None,
        Meta(
            description="directory of the prefix cache's disk tier, shared by every model and "
            "replica of this user; unset = kv-disk in the engine home"
        ),
    ] = None
    kv_disk_size: Annotated[
        int,
        Meta(
            ge=1,
            description="bytes the disk tier may hold (e.g. 20GiB); beyond, the least "
            "recently used blocks go",
            extra=BYTES_UNIT,
        ),
    ] = 8 * 2**30


class SchedulerSettings(_Section, frozen=True):
    max_num_seqs: Annotated[int, Meta(ge=1, description="most sequences running in one batch")] = (
        256
    )
    # vLLM-CPU's server default. A step's prefill tokens hold up every running decode, so a
    # larger budget lets a burst of prompts stretch every stream's inter-token gap without
    # raising throughput.
    max_num_batched_tokens: Annotated[
        int, Meta(ge=1, description="most tokens in one step (longer prefills are chunked)")
    ] = 2048
    max_queued_samples: Annotated[
        int,
        Meta(
            ge=1,
            description="waiting samples (a request with n samples counts n) beyond which new "
            "requests get 429",
        ),
    ] = 1024
    speculative_config: Annotated[
        str,
        Meta(
            description="speculative decoding, vLLM's JSON: n-gram (prompt-lookup) proposals, "
            'e.g. {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
            '"prompt_lookup_min": 2}, or a draft model sharing the tokenizer, e.g. {"model": '
            '"/path/to/draft", "num_speculative_tokens": 4} (its sampled proposals verified '
            'against the target\'s own draws, or with "acceptance_method": "rejection_sampler" '
            "by vLLM's rule); empty: off"
        ),
    ] = ""


class LimitsSettings(_Section, frozen=True):
    """What one request may ask for; beyond it the request is refused with 400 naming the limit.

    Each bounds something that grows with a request's input through every actor it passes
    (samples run, stop strings matched at every token, prompt text tokenized).
    """

    max_n: Annotated[int, Meta(ge=1, description="most samples (n) one request may ask for")] = 128
    max_stop_strings: Annotated[
        int, Meta(ge=0, description="most stop strings one request may give")
    ] = 64
    max_stop_chars: Annotated[
        int, Meta(ge=0, description="most characters in all of a request's stop strings")
    ] = 8192
    max_request_tokens: Annotated[
        int,
        Meta(
            ge=1,
            description="most tokens one request may ask to generate: n x max_tokens "
            "(max_tokens unset counts as default_max_tokens, or max_model_len)",
        ),
    ] = 1 << 20
    default_max_tokens: Annotated[
        int,
        Meta(
            ge=0,
            description="output tokens of a sample whose request sets no max_tokens (nor the "
            "model's max_new_tokens); 0 = up to max_model_len, as vLLM",
        ),
    ] = 2048
    max_prompt_chars_per_token: Annotated[
        int,
        Meta(
            ge=1,
            description="prompt text (or chat contents) longer than max_model_len x this many "
            "characters is refused before it is tokenized",
        ),
    ] = 32
    template_cpu_seconds: Annotated[
        float,
        Meta(
            gt=0.0,
            description="CPU seconds one chat template rendering may take (a client's template "
            "to /tokenize included); past it, 400. Its output is bounded as prompt text is "
            "(max_model_len x max_prompt_chars_per_token characters)",
        ),
    ] = 1.0
    max_grammar_chars: Annotated[
        int,
        Meta(
            ge=1,
            description="most characters in a request's structured-output constraint (its JSON "
            "schema, regex, choices or grammar)",
        ),
    ] = 1 << 18


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
    collective_timeout: Annotated[
        float,
        Meta(
            gt=0.0,
            description="seconds a tensor-parallel collective waits for a rank that does not "
            "join before failing; the group then restarts",
        ),
    ] = 300.0


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
        float,
        Meta(gt=0.0, description="seconds between an actor's heartbeats (sent from a thread)"),
    ] = 0.5
    heartbeat_timeout: Annotated[
        float,
        Meta(
            gt=0.0,
            description="seconds without a heartbeat before an actor counts as hung (a model "
            "step is judged by a deadline from its own size instead; a stopped process at once)",
        ),
    ] = 2.0
    stall_timeout: Annotated[
        float,
        Meta(
            gt=0.0,
            description="seconds an actor's event loop may go without turning, outside a model "
            "step, before the actor counts as hung",
        ),
    ] = 10.0
    stopped_timeout: Annotated[
        float,
        Meta(
            gt=0.0,
            description="seconds an actor's process may stay stopped by a signal (SIGSTOP, a "
            "debugger) before it counts as hung",
        ),
    ] = 0.5
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
        Meta(
            ge=0,
            le=1024,
            description="torch threads per CPU worker rank; 0 = the host's cores shared by its "
            "ranks",
        ),
    ] = 0
    quarantine_after: Annotated[
        int,
        Meta(ge=1, description="crashes a request may be part of before it is failed, not retried"),
    ] = 2
    spare_processes: Annotated[
        bool,
        Meta(
            description="keep one started process per kind of actor, with its imports done, "
            "for its next restart (faster recovery, for the spares' memory)"
        ),
    ] = True


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: ModelSettings = msgspec.field(default_factory=ModelSettings)
    cache: CacheSettings = msgspec.field(default_factory=CacheSettings)
    scheduler: SchedulerSettings = msgspec.field(default_factory=SchedulerSettings)
    limits: LimitsSettings = msgspec.field(default_factory=LimitsSettings)
    parallel: ParallelSettings = msgspec.field(default_factory=ParallelSettings)
    server: ServerSettings = msgspec.field(default_factory=ServerSettings)
    admin: AdminSettings = msgspec.field(default_factory=AdminSettings)
    runtime: RuntimeSettings = msgspec.field(default_factory=RuntimeSettings)
    kv_transfer: KvTransferSettings = msgspec.field(default_factory=KvTransferSettings)
    lora: LoraSettings = msgspec.field(default_factory=LoraSettings)
    models: ModelsSettings = msgspec.field(default_factory=ModelsSettings)


SECTIONS: dict[str, type[_Section]] = {
    "model": ModelSettings,
    "cache": CacheSettings,
    "scheduler": SchedulerSettings,
    "limits": LimitsSettings,
    "parallel": ParallelSettings,
    "server": ServerSettings,
    "admin": AdminSettings,
    "runtime": RuntimeSettings,
    "kv_transfer": KvTransferSettings,
    "lora": LoraSettings,
    "models": ModelsSettings,
}


def cross_field_problems(settings: Settings) -> list[tuple[str, str]]:
    """Rules between settings, as (the setting at fault, what is wrong with it)."""
    problems = []
    runtime, scheduler = settings.runtime, settings.scheduler
    if runtime.heartbeat_timeout <= runtime.heartbeat_interval:
        problems.append(
            (
                "runtime.heartbeat_timeout",
                f"must be greater than runtime.heartbeat_interval ({runtime.heartbeat_interval}), "
                f"got {runtime.heartbeat_timeout}",
            )
        )
    if scheduler.max_num_batched_tokens < scheduler.max_num_seqs:
        # A step gives each running sequence at least one token: with fewer tokens than
        # sequences, the later ones would wait forever while holding their KV blocks.
        problems.append(
            (
                "scheduler.max_num_batched_tokens",
                f"must be at least scheduler.max_num_seqs ({scheduler.max_num_seqs}) so that every "
                f"running sequence gets a token each step, got {scheduler.max_num_batched_tokens}",
            )
        )
    return [
        *problems,
        *server_problems(settings.server),
        *model_problems(settings.model),
        *kv_transfer_problems(settings),
        *lora_problems(settings),
        *models_problems(settings.models),
    ]
