"""Where and how the model runs: device, dtype, threads and the KV cache budget, decided once.

Pure rules over plain values (no torch: the root plans with them before any worker exists, and
the runner and loader apply the same ones), so that each rule has one home and one wording.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Mapping

from engine.kernels.packed_weights import packed_copies, packed_copy_bytes, packs_decoder
from engine.model.config import ModelConfig
from engine.model.loading.weight_names import matrix_shapes
from engine.model.placement.capacity import dtype_bytes

DEVICES = "'auto', 'cpu', 'cuda' or 'cuda:N'"
SUPPORTED_DTYPES = {
    "cpu": ("float32", "bfloat16"),
    "cuda": ("float16", "bfloat16", "float32"),
}
# On CPU an unset kv_cache_memory means this much at most per rank (vLLM-CPU's default is 4 GiB).
CPU_KV_CACHE_MAX_BYTES = 2 * 2**30
_CUDA_INDEX = re.compile(r"cuda:(\d+)")


def gpu_visible() -> bool:
    """Whether an NVIDIA GPU is visible to this process (without importing torch)."""
    return os.path.exists("/dev/nvidiactl") and os.environ.get("CUDA_VISIBLE_DEVICES") != ""


def resolve_device(requested: str) -> str:
    """ "auto" is cuda when a GPU is visible, else cpu; anything but a known device is refused."""
    if requested == "auto":
        return "cuda" if gpu_visible() else "cpu"
    if requested in ("cpu", "cuda") or _CUDA_INDEX.fullmatch(requested):
        return requested
    raise ValueError(f"unsupported device {requested!r}; expected {DEVICES}")


def device_type(device: str) -> str:
    return device.partition(":")[0]


def rank_device(device: str, local_rank: int, device_count: int) -> str:
    """The device of the `local_rank`-th rank on this host: on CUDA, GPU `local_rank`."""
    if device != "cuda":
        return device
    if local_rank >= device_count:
        raise ValueError(
            f"rank {local_rank} of this host needs GPU cuda:{local_rank}, but {device_count} "
            f"GPU(s) are visible: run at most {device_count} ranks per host"
        )
    return f"cuda:{local_rank}"


def resolve_dtype(requested: str, checkpoint_dtype: str | None, device: str) -> str:
    """The dtype to run in. "auto" is the checkpoint's, except float16 on the CPU (slow and
    unsupported there: float32) and float32 on a GPU (bfloat16)."""
    kind = device_type(device)
    if requested == "auto":
        dtype = checkpoint_dtype if checkpoint_dtype in SUPPORTED_DTYPES["cuda"] else "float32"
        if kind == "cpu" and dtype == "float16":
            return "float32"
        if kind == "cuda" and dtype == "float32":
            return "bfloat16"
        return dtype
    if requested not in SUPPORTED_DTYPES["cuda"]:
        raise ValueError(
            f"unknown dtype {requested!r}; expected 'auto', 'float32', 'bfloat16' or 'float16'"
        )
    allowed = SUPPORTED_DTYPES[kind]
    if requested not in allowed:
        raise ValueError(
            f"dtype {requested!r} is not supported on {kind}; use {', '.join(allowed)}"
        )
    return requested


def dtype_note(
    requested: str, checkpoint_dtype: str | None, dtype: str, device: str, quantized: bool
) -> str:
    """The start log's line on the dtype served, and where `--dtype auto` differs from
    vLLM-CPU's, which on x86 serves a float32 checkpoint in bfloat16 and a float16 one in
    float16: here a float32 checkpoint stays float32, exact against transformers' float32, and a
    float16 one is widened to it (the CPU kernels hold no float16); `--dtype bfloat16` serves
    either in bfloat16, on the bfloat16 kernels. Quantized weights compute in float32 (vLLM-CPU
    serves no GGUF file to compare with)."""
    line = f"dtype: {dtype} (--dtype {requested}; the checkpoint's {checkpoint_dtype or 'unset'})"
    if (
        requested == "auto"
        and device_type(device) == "cpu"
        and dtype == "float32"
        and not quantized
    ):
        theirs = "float16" if checkpoint_dtype == "float16" else "bfloat16"
        line += (
            f"; vLLM-CPU's --dtype auto serves it in {theirs}: --dtype bfloat16 for half the "
            "weights' bytes and faster steps"
        )
    return line


KV_CACHE_DTYPES = ("float32", "float16", "bfloat16", "int8")  # kernels/kv_cache.py's formats


def resolve_kv_cache_dtype(
    requested: str, dtype: str, device: str, kernel_backend: str, quantized: bool
) -> str:
    """The KV cache's dtype. "auto" is the model's `dtype`, except on the CPU for quantized
    weights (float32 activations): float16, half the bytes, as llama.cpp's f16 cache; the
    float32 cache stays where float32 weights ask for float32's exactness. On a GPU, and for the
    triton kernels, the cache has the model's dtype (their kernels read no other)."""
    own_dtype_only = device_type(device) != "cpu" or kernel_backend == "triton"
    if requested == "auto":
        return "float16" if dtype == "float32" and quantized and not own_dtype_only else dtype
    if requested not in KV_CACHE_DTYPES:
        raise ValueError(
            f"unknown KV cache dtype {requested!r}; expected 'auto' or one of "
            f"{', '.join(KV_CACHE_DTYPES)}"
        )
    if own_dtype_only and requested != dtype:
        where = "the triton kernels" if kernel_backend == "triton" else device_type(device)
        raise ValueError(
            f"KV cache dtype {requested!r} is not supported on {where}: use 'auto' (the "
            f"model's, {dtype})"
        )
    return requested


# Steps with at least this many tokens, or whose attention reads at least this many keys, run
# on ThreadPolicy.busy threads.
BUSY_STEP_TOKENS = 128
BUSY_STEP_KEYS = 16384


@dataclasses.dataclass(frozen=True)
class ThreadPolicy:
    """torch threads of a CPU worker rank, chosen per step: a small step on `light` threads, a
    step of at least `busy_from_tokens` tokens, or whose attention reads at least
    `busy_from_keys` keys, on `busy` ones.

    The engine's own policy (thread_policy) gives every step every core of the rank. Leaving a
    small step a core fewer, for the other actors, would cost more than it saves: idle OpenMP
    threads sleep (OMP_WAIT_POLICY=PASSIVE, set by the worker), so a waiting thread does not
    spin against the actors that need its core; a small decode step is one C++ call on the
    kernels' own pool, asleep within 50 us of its last call (model/fused_decode.py,
    kernels/cpu/thread_pool.h); and the other actors use only a sliver of a core while serving
    (engine:actor_cpu_seconds_total). docs/parallelism.md has the figures. Different
    light and busy counts remain for a caller that sets them (ModelRunner's num_threads and
    busy_threads)."""

    light: int
    busy: int
    busy_from_tokens: int = BUSY_STEP_TOKENS
    busy_from_keys: int = BUSY_STEP_KEYS

    def threads_for(self, step_tokens: int, step_keys: int = 0) -> int:
        """Threads for a step of `step_tokens` tokens whose attention reads `step_keys` keys."""
        busy = step_tokens >= self.busy_from_tokens or step_keys >= self.busy_from_keys
        return self.busy if busy else self.light


def thread_policy(
    requested: int, cores: int, local_ranks: int, batch_invariant: bool = False
) -> ThreadPolicy:
    """`requested` threads for every step when set (> 0); else the host's cores shared by its
    ranks (ThreadPolicy says why every step gets them all). The batch-invariant backend
    (deterministic mode) runs small steps on one thread: on more, a matmul of few rows may split
    its sums across threads, so a row's bits would depend on the rows beside it, and a resumed
    stream's logprobs would differ from the undisturbed run's
    (tests/integration/test_deterministic_recovery.py)."""
    if requested > 0:
        return ThreadPolicy(requested, requested)
    share = max(1, cores // max(1, local_ranks))
    return ThreadPolicy(light=1 if batch_invariant else share, busy=share)


def oversubscription(local_ranks: int, threads: int, cores: int) -> str | None:
    """A warning when this host's worker ranks run more threads than it has cores, else None.
    Each step of a TP group waits for its slowest rank, and ranks that share a core take turns:
    decoding slows to a fraction of one rank's speed (the README's Parallelism section)."""
    if local_ranks * threads <= cores:
        return None
    return (
        f"{local_ranks} worker ranks x {threads} threads = {local_ranks * threads} threads on "
        f"{cores} cores: ranks that share a core wait for each other at every step, and decoding "
        f"runs at a fraction of one rank's speed; use at most {cores} ranks x threads here "
        "(--tp, --dp, --runtime.worker_threads)"
    )


def worker_threads(
    requested: int, cores: int, local_ranks: int, batch_invariant: bool = False
) -> int:
    """torch threads of each CPU worker rank for small steps (ThreadPolicy.light)."""
    return thread_policy(requested, cores, local_ranks, batch_invariant).light


def sleeping_openmp_threads() -> None:
    """For a process that runs the model on the CPU (a worker, or a benchmark measuring what a
    worker does), before torch loads OpenMP: idle OpenMP threads sleep rather than spin. With two
    OpenMP threads on a small machine, a spinning barrier thread fights the other actors, and the
    attention kernel's helper, for the other core, and the step waits for whichever thread lost
    it; a sleeping one gives the core back. The caller's own OMP_WAIT_POLICY wins."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def available_cores() -> int:
    return len(os.sched_getaffinity(0))


def weight_bytes(config: ModelConfig, dtype: str, tensor_parallel_size: int = 1) -> int:
    """Bytes of one rank's weights (each rank holds about 1/tp of every sharded matrix)."""
    hidden, heads, kv_heads = config.hidden_size, config.num_heads, config.num_kv_heads
    q_out, kv_out = heads * config.head_dim, kv_heads * config.head_dim
    attention = hidden * (q_out + 2 * kv_out) + q_out * hidden
    norms = (4 if config.sandwich_norms else 2) * hidden
    if config.qk_norm:
        norms += 2 * config.head_dim
    if config.qk_norm_whole:
        norms += q_out + kv_out
    if config.qkv_bias:
        attention += q_out + 2 * kv_out
    if config.o_bias:
        attention += hidden
    dense = 3 * hidden * config.intermediate_size
    if config.mlp_bias:
        dense += 2 * config.intermediate_size + hidden
    experts = config.num_experts * hidden * (3 * config.expert_intermediate_size + 1)
    params = sum(
        attention + norms + (experts if config.is_moe_layer(layer) else dense)
        for layer in range(config.num_layers)
    )
    params += config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2) + hidden
    return params * dtype_bytes(dtype) // tensor_parallel_size


def packed_weight_bytes(
    config: ModelConfig, dtype: str, tensor_parallel_size: int = 1, quantized: Iterable[str] = ()
) -> int:
    """Bytes of one rank's packed copies on the CPU (engine/kernels/packed_weights.py): the
    vocabulary projection's, and the decoder's matmul weights' when they are small enough to be
    packed (made by the compiled CPU backend; counted whichever backend runs, as the plan is made
    before a worker chooses one). Weights served `quantized` (parameter names) have none."""
    skip = set(quantized)
    size = dtype_bytes(dtype)
    decoder: list[int] = []
    head: list[int] = []
    for name, (rows, columns) in matrix_shapes(config).items():
        if name in skip or (name == "embed_tokens.weight" and not config.tie_word_embeddings):
            continue
        if ".experts." in name:  # a MoE layer's float experts run unpacked
            continue
        nbytes = rows * columns * size // tensor_parallel_size
        (decoder if name.startswith("layers.") else head).append(nbytes)
    counted = [*head, *decoder] if packs_decoder(sum(decoder)) else head
    return packed_copy_bytes(counted) * packed_copies(dtype)


def resident_weight_bytes(
    config: ModelConfig,
    dtype: str,
    tensor_parallel_size: int,
    device: str,
    quantized: Mapping[str, int] | None = None,
) -> int:
    """The memory one rank's weights take: the checkpoint's, on the CPU their packed copies, and
    for the weights served quantized (parameter name -> bytes of its packed weight,
    quantized_formats.quantized_bytes) those bytes in place of both."""
    weights = weight_bytes(config, dtype, tensor_parallel_size)
    quantized = quantized or {}
    shapes = matrix_shapes(config)
    for name, size in quantized.items():
        rows, columns = shapes[name]
        weights += size - rows * columns * dtype_bytes(dtype)
    if device_type(device) != "cpu":
        return weights
    return weights + packed_weight_bytes(config, dtype, tensor_parallel_size, quantized)


def weight_bytes_by_format(
    config: ModelConfig,
    dtype: str,
    tensor_parallel_size: int,
    device: str,
    quantized: Mapping[str, tuple[str, int]] | None = None,
) -> dict[str, int]:
    """resident_weight_bytes split by what the bytes are: each quantized source ("Q4_1",
    "q8_0"; `quantized` maps parameter name -> (source, packed bytes)) and `dtype` for the rest
    (with the float weights' packed copies)."""
    quantized = quantized or {}
    split: dict[str, int] = {}
    for source, size in quantized.values():
        split[source] = split.get(source, 0) + size
    total = resident_weight_bytes(
        config, dtype, tensor_parallel_size, device, {n: b for n, (_, b) in quantized.items()}
    )
    split[dtype] = split.get(dtype, 0) + total - sum(split.values())
    return split


def kv_cache_bytes(
    *,
    kv_cache_memory: int | None,
    memory_fraction: float,
    available_memory: int,
    weights_per_rank: int,
    ranks_on_device: int,
    device: str,
) -> int:
    """One rank's KV cache budget.

    `kv_cache_memory` when set. Otherwise `memory_fraction` (cache.kv_cache_fraction) is the
    share of the memory available at start (on the device) that the engine's weights and KV
    cache may take together; the KV cache gets what the weights leave of it, split among the
    ranks sharing the memory, and on CPU at most CPU_KV_CACHE_MAX_BYTES per rank.
    """
    if kv_cache_memory is not None:
        return kv_cache_memory
    if not 0.0 < memory_fraction <= 1.0:
        raise ValueError(f"kv_cache_fraction must be in (0, 1], got {memory_fraction}")
    share = int(available_memory * memory_fraction) // ranks_on_device - weights_per_rank
    if share <= 0:
        raise ValueError(
            f"cache.kv_cache_fraction {memory_fraction} of the {available_memory / 2**30:.1f} "
            f"GiB available leaves no room for a KV cache after {weights_per_rank / 2**30:.2f} "
            f"GiB of weights per rank; raise it or set cache.kv_cache_memory"
        )
    return min(share, CPU_KV_CACHE_MAX_BYTES) if device_type(device) == "cpu" else share
