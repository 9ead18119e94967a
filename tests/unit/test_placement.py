"""The placement rules (device, dtype, threads, KV budget) as pure functions."""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch

from engine.gguf.hf_config import hf_config
from engine.gguf.reader import read_gguf
from engine.kernels.cpu.build import EXTRA_FLAGS_VARIABLE
from engine.kernels.packed_weights import (
    BF16_PATH_VARIABLE,
    PACKED_WEIGHT_LIMIT,
    cpu_has_amx,
    packed_copies,
)
from engine.launch.model_source import default_model_file
from engine.launch.sizing import threads_per_rank
from engine.model.config import load_model_config, parse_model_config
from engine.model.parallel.config import Placement
from engine.model.parallel.layout import check_tensor_parallel
from engine.model.placement.capacity import available_cpu_memory
from engine.model.placement.policy import (
    BUSY_STEP_KEYS,
    BUSY_STEP_TOKENS,
    CPU_KV_CACHE_MAX_BYTES,
    available_cores,
    kv_cache_bytes,
    packed_weight_bytes,
    rank_device,
    resident_weight_bytes,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
    thread_policy,
    weight_bytes,
    worker_threads,
)
from engine.settings import load_settings
from tests.checkpoints import hf_model, tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]

MIB = 2**20


def test_devices_are_validated_and_ranks_get_their_own_gpu() -> None:
    assert resolve_device("cpu") == "cpu" and resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(ValueError, match=r"'tpu'.*'auto', 'cpu', 'cuda' or 'cuda:N'"):
        resolve_device("tpu")
    assert [rank_device("cuda", rank, 2) for rank in range(2)] == ["cuda:0", "cuda:1"]
    assert rank_device("cpu", 3, 0) == "cpu"
    with pytest.raises(ValueError, match="needs GPU cuda:2, but 2 GPU"):
        rank_device("cuda", 2, 2)


@pytest.mark.parametrize(
    ("requested", "checkpoint", "device", "expected"),
    [
        ("auto", "bfloat16", "cpu", "bfloat16"),
        ("auto", "float16", "cpu", "float32"),
        ("auto", "float32", "cuda", "bfloat16"),
        ("auto", None, "cpu", "float32"),
        ("float16", "float32", "cuda:0", "float16"),
    ],
)
def test_dtype_rule(requested: str, checkpoint: str | None, device: str, expected: str) -> None:
    assert resolve_dtype(requested, checkpoint, device) == expected


def test_an_unsupported_dtype_names_what_works() -> None:
    with pytest.raises(
        ValueError, match="'float16' is not supported on cpu; use float32, bfloat16"
    ):
        resolve_dtype("float16", None, "cpu")


@pytest.mark.parametrize(
    ("requested", "dtype", "device", "backend", "quantized", "expected"),
    [
        ("auto", "float32", "cpu", "cpu", False, "float32"),  # float32's exactness
        ("auto", "float32", "cpu", "auto", True, "float16"),  # quantized weights: llama.cpp's f16
        ("auto", "bfloat16", "cpu", "cpu", False, "bfloat16"),
        ("auto", "float32", "cpu", "triton", True, "float32"),  # triton reads the model's only
        ("auto", "bfloat16", "cuda", "auto", True, "bfloat16"),
        ("int8", "float32", "cpu", "batch_invariant", False, "int8"),
        ("float16", "bfloat16", "cpu", "torch", False, "float16"),
        ("bfloat16", "bfloat16", "cuda:0", "auto", False, "bfloat16"),
    ],
)
def test_kv_cache_dtype_rule(
    requested: str, dtype: str, device: str, backend: str, quantized: bool, expected: str
) -> None:
    assert resolve_kv_cache_dtype(requested, dtype, device, backend, quantized) == expected


def test_a_kv_cache_dtype_the_kernels_cannot_read_is_refused() -> None:
    with pytest.raises(ValueError, match="'int8' is not supported on cuda: use 'auto'"):
        resolve_kv_cache_dtype("int8", "bfloat16", "cuda", "auto", False)
    with pytest.raises(ValueError, match="'float16' is not supported on the triton kernels"):
        resolve_kv_cache_dtype("float16", "float32", "cpu", "triton", False)
    with pytest.raises(ValueError, match="unknown KV cache dtype 'fp4'"):
        resolve_kv_cache_dtype("fp4", "float32", "cpu", "cpu", False)


@pytest.mark.parametrize(
    ("requested", "cores", "ranks", "expected"),
    [(0, 2, 1, 2), (0, 16, 1, 16), (0, 16, 4, 4), (0, 2, 2, 1), (0, 3, 2, 1), (6, 2, 1, 6)],
)
def test_worker_threads(requested: int, cores: int, ranks: int, expected: int) -> None:
    assert worker_threads(requested, cores, ranks) == expected


@pytest.mark.parametrize(
    ("requested", "cores", "ranks", "small_step", "large_step"),
    [(0, 2, 1, 2, 2), (0, 16, 4, 4, 4), (0, 2, 2, 1, 1), (6, 2, 1, 6, 6)],
)
def test_thread_policy_per_step(
    requested: int, cores: int, ranks: int, small_step: int, large_step: int
) -> None:
    policy = thread_policy(requested, cores, ranks)
    assert policy.threads_for(1) == policy.threads_for(BUSY_STEP_TOKENS - 1) == small_step
    assert policy.threads_for(BUSY_STEP_TOKENS) == policy.threads_for(4096) == large_step
    # A few tokens that attend to a long context (a batch of long decodes) count as large.
    assert policy.threads_for(32, BUSY_STEP_KEYS - 1) == small_step
    assert policy.threads_for(32, BUSY_STEP_KEYS) == policy.threads_for(1, 10**6) == large_step


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_weight_bytes_count_every_parameter_of_the_checkpoint(arch: str) -> None:
    path = tiny_checkpoint(arch)
    config = load_model_config(str(path))
    counted = sum(p.numel() for p in hf_model(path).parameters())
    assert weight_bytes(config, "float32") == counted * 4
    assert weight_bytes(config, "bfloat16", tensor_parallel_size=2) == counted * 2 // 2


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_packed_copies_are_the_checkpoints_matmul_weights_under_the_limit(arch: str) -> None:
    """The plan counts a packed copy of every decoder matmul weight and of the vocabulary
    projection (the HF model's nn.Linear weights), and none of a weight over the limit."""
    path = tiny_checkpoint(arch)
    config = load_model_config(str(path))
    linears = [m for m in hf_model(path).modules() if isinstance(m, torch.nn.Linear)]
    matmul_bytes = sum(m.weight.numel() * 4 for m in linears)
    assert packed_weight_bytes(config, "float32") == matmul_bytes
    # bfloat16: the kernel's copy, and oneDNN's where the CPU has AMX
    bf16 = packed_weight_bytes(config, "bfloat16", tensor_parallel_size=2)
    assert bf16 == matmul_bytes // 4 * packed_copies("bfloat16")
    # A vocabulary projection of 4 x PACKED_WEIGHT_LIMIT bytes in float32 gets no copy.
    wide = dataclasses.replace(config, vocab_size=PACKED_WEIGHT_LIMIT // config.hidden_size)
    head_bytes = config.vocab_size * config.hidden_size * 4
    assert packed_weight_bytes(wide, "float32") == matmul_bytes - head_bytes
    on_cpu = resident_weight_bytes(config, "float32", 1, "cpu")
    assert on_cpu == weight_bytes(config, "float32") + matmul_bytes
    assert resident_weight_bytes(config, "float32", 1, "cuda") == weight_bytes(config, "float32")


def test_a_second_bfloat16_copy_is_counted_only_on_a_cpu_with_amx(tmp_path: Path) -> None:
    for flags, expected in (("avx512f avx512_bf16 amx_bf16 amx_tile", True), ("avx2 fma", False)):
        cpuinfo = tmp_path / f"cpuinfo-{expected}"
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        assert cpu_has_amx(cpuinfo) is expected
    assert not cpu_has_amx(tmp_path / "missing")
    assert packed_copies("float32") == 1
    # an AVX2 machine imitated (its kernels' build, or their bfloat16 path): no oneDNN copy
    for variable, value in ((BF16_PATH_VARIABLE, "avx2"), (EXTRA_FLAGS_VARIABLE, "-mno-avx512f")):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(variable, value)
            assert packed_copies("bfloat16") == 1


def test_the_kv_budget_is_the_share_the_weights_leave() -> None:
    def budget(**overrides: object) -> int:
        given: dict[str, object] = {
            "kv_cache_memory": None,
            "memory_fraction": 0.5,
            "available_memory": 1024 * MIB,
            "weights_per_rank": 100 * MIB,
            "ranks_on_device": 1,
            "device": "cpu",
        }
        return kv_cache_bytes(**{**given, **overrides})  # type: ignore[arg-type]

    assert budget() == 512 * MIB - 100 * MIB
    assert budget(ranks_on_device=2) == 256 * MIB - 100 * MIB  # each rank: its share, its weights
    assert budget(kv_cache_memory=12345) == 12345
    assert budget(available_memory=2**40) == CPU_KV_CACHE_MAX_BYTES
    with pytest.raises(ValueError, match="leaves no room for a KV cache"):
        budget(weights_per_rank=512 * MIB)
    # A GPU's budget is the device's own free memory, with no CPU cap.
    assert budget(device="cuda", available_memory=2**40) == 2**39 - 100 * MIB
    with pytest.raises(ValueError, match=r"kv_cache_fraction must be in \(0, 1\], got 1.5"):
        budget(memory_fraction=1.5)


def write_files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


MEMINFO = {"proc/meminfo": "MemTotal: 67108864 kB\nMemAvailable: 33554432 kB\n"}  # 32 GiB free


def test_a_containers_memory_limit_bounds_the_memory_to_size_from(tmp_path: Path) -> None:
    """In a container the host's free memory is not the process's: the KV cache is sized from
    what the cgroup's limit leaves (usage minus the page cache it can drop), in cgroup v2 and v1
    layouts, at the process's cgroup or one above it; without a limit, the host's."""
    proc, cgroups = tmp_path / "proc", tmp_path / "sys"

    def available(files: dict[str, str]) -> int:
        for path in (proc, cgroups):
            if path.exists():
                shutil.rmtree(path)
        write_files(tmp_path, {**MEMINFO, **files})
        return available_cpu_memory(proc, cgroups)

    host = 32 * 2**30
    # cgroup v2, a pod's limit of 3 GiB: 1 GiB used, 256 MiB of it droppable page cache.
    v2 = {
        "proc/self/cgroup": "0::/kubepods/pod1/engine\n",
        "sys/kubepods/pod1/engine/memory.max": f"{3 * 2**30}\n",
        "sys/kubepods/pod1/engine/memory.current": f"{2**30}\n",
        "sys/kubepods/pod1/engine/memory.stat": f"anon 1\ninactive_file {256 * MIB}\n",
    }
    assert available(v2) == 3 * 2**30 - 2**30 + 256 * MIB
    # A tighter limit one level up (the pod's) wins; "max" is no limit.
    pod = {"sys/kubepods/pod1/memory.max": f"{2**30}\n", "sys/kubepods/pod1/memory.current": "0"}
    assert available({**v2, **pod}) == 2**30
    assert available({**v2, "sys/kubepods/pod1/engine/memory.max": "max\n"}) == host
    # A container that sees its own cgroup as the root (the path it is told is not mounted).
    assert (
        available(
            {
                "proc/self/cgroup": "0::/\n",
                "sys/memory.max": f"{2**30}\n",
                "sys/memory.current": "0",
            }
        )
        == 2**30
    )
    # cgroup v1; its "no limit" is the largest page-aligned int64.
    v1 = {
        "proc/self/cgroup": "4:memory:/docker/abc\n3:cpu:/docker/abc\n",
        "sys/memory/docker/abc/memory.limit_in_bytes": f"{2**31}\n",
        "sys/memory/docker/abc/memory.usage_in_bytes": f"{2**30}\n",
        "sys/memory/docker/abc/memory.stat": f"total_inactive_file {MIB}\n",
    }
    assert available(v1) == 2**31 - 2**30 + MIB
    unlimited = {"sys/memory/docker/abc/memory.limit_in_bytes": "9223372036854771712\n"}
    assert available({**v1, **unlimited}) == host
    # A limit above what the host has free leaves the host's figure; no cgroup file: the host's.
    assert available({**v2, "sys/kubepods/pod1/engine/memory.max": f"{2**40}\n"}) == host
    assert available({}) == host


def test_the_batch_invariant_backend_runs_small_steps_on_one_thread() -> None:
    policy = thread_policy(0, cores=16, local_ranks=1, batch_invariant=True)
    assert (policy.threads_for(1), policy.threads_for(BUSY_STEP_TOKENS)) == (1, 16)
    assert worker_threads(0, 2, 1, batch_invariant=True) == 1
    assert thread_policy(4, cores=16, local_ranks=1, batch_invariant=True).light == 4  # asked


def test_more_worker_threads_than_cores_is_warned_at_start_with_the_figures(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Ranks that share cores wait for each other at every step (issue 47: --tp 3 on 2 cores
    decoded at 3.8 tokens/s against ~120 with one rank); the start says so, with the numbers."""
    cores = available_cores()
    crowded, _ = load_settings(["--tp", "2", "--runtime.worker_threads", str(cores)], {})
    with caplog.at_level(logging.WARNING, logger="engine.launch"):
        threads_per_rank(crowded, "cpu", Placement(2, 1, 1, 0))
        warned = caplog.text
        caplog.clear()
        threads_per_rank(load_settings(["--tp", "2"], {})[0], "cpu", Placement(2, 1, 1, 0))
        threads_per_rank(load_settings([], {})[0], "cpu", Placement(1, 1, 1, 0))
    figures = f"2 worker ranks x {cores} threads = {2 * cores} threads on {cores} cores"
    assert figures in warned and "--tp" in warned
    if cores >= 2:  # the engine's own share (cores // ranks each) fits
        assert caplog.text == ""


def test_the_docs_tensor_parallel_examples_run_on_the_default_model() -> None:
    """Every `--tp N` the docs show without naming another model splits the default model."""
    config = parse_model_config(hf_config(read_gguf(default_model_file())))
    lines = (REPO / "docs" / "parallelism.md").read_text().splitlines()
    lines += (REPO / "docs" / "serving.md").read_text().splitlines()
    sizes = [
        int(match[1])
        for line in lines
        if line.lstrip().startswith("python -m engine") and "--model" not in line
        for match in [re.search(r"--tp (\d+)", line)]
        if match
    ]
    assert sizes, "no tensor-parallel example on the default model"
    for size in sizes:
        check_tensor_parallel(config, size)
    with pytest.raises(ValueError, match="num_attention_heads 9 is not divisible by 2"):
        check_tensor_parallel(config, 2)
