"""What each actor is started with: one msgspec Struct per role, encoded into its ChildSpec by
the plan (engine/launch/) and decoded by the actor in on_start. Kept apart from the actors so the
root can plan without importing them. The scheduler's is its domain object's
(engine/scheduler/config.py), which validates it.
"""

from __future__ import annotations

import msgspec

from engine.messages.kv_transfer import KvLayout
from engine.model.parallel.config import TensorParallelConfig


class TokenizerConfig(msgspec.Struct, frozen=True):
    model_path: str
    max_model_len: int
    vocab_size: int
    allow_special_tokens_in_chat: bool = False
    # A chat rendering's bounds (engine/text/template_bounds.py): characters and CPU seconds;
    # 0: PromptBuilder's defaults
    template_chars: int = 0
    template_cpu_seconds: float = 0.0


class DetokenizerConfig(msgspec.Struct, frozen=True):
    model_path: str


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
    kv_cache_dtype: str = "auto"  # the cache's (placement.resolve_kv_cache_dtype, by the root)
    quantization: str = "auto"  # model.quantization (engine/model/quantized/formats.py)
    engine_home: str = ""  # runtime.engine_home, where the CPU kernel is built; "": $ENGINE_HOME
    tensor_parallel: TensorParallelConfig | None = None  # None: a group of one
    # P/D: the SegmentDecl its KV cache lives in (its kv_transfer actor maps it too); "": none.
    kv_cache_segment: str = ""
    # Speculative decoding's draft model, checked against the target (engine/launch/draft.py):
    # rank 0 runs it (engine/model/speculation/drafter.py); "": none.
    draft_model_path: str = ""
    # Its sampled proposals verified by vLLM's rejection sampler, not the target's own draws.
    draft_rejection_sampling: bool = False
    max_lora_rank: int = 0  # LoRA adapters up to this rank (engine/model/lora/weights.py); 0: off
    max_cpu_loras: int = 1  # adapters kept loaded, the least recently used dropped


class KvTransferConfig(msgspec.Struct, frozen=True, kw_only=True):
    rank: int
    layout: KvLayout  # this rank's cache, as the worker lays it out in the segment
    cache_segment: str  # logical name of the cache's SegmentDecl (self.segments[name])
    listen_host: str = "127.0.0.1"
    port_base: int = 0  # 0: an ephemeral port; else port_base + rank (multi-host: known ports)
    advertised_host: str = ""  # what pullers connect to; "" means listen_host
    force_tcp: bool = False  # pull over TCP even from a same-host source (tests, benchmarks)
    idle_timeout: float = 30.0  # a connection with no request for this long is closed
    # The deployment secret (engine/kv/transfer/secret.py); b"": this user's secret file in the
    # default engine home, as an instance started with --kv-role finds it.
    secret: bytes = b""
    tls_cert: str = ""  # all three set: connections run inside TLS (engine/kv/transfer/tls.py)
    tls_key: str = ""
    tls_ca: str = ""

    @property
    def port(self) -> int:
        return self.port_base + self.rank if self.port_base else 0

    def __repr__(self) -> str:  # the secret never reaches a log line
        return f"KvTransferConfig(rank={self.rank}, port={self.port}, secret=<redacted>)"
