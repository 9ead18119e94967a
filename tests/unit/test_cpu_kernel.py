"""The compiled CPU attention kernel (engine/kernels/cpu) where test_kernels does not reach: its
thread pool, its build from scratch, and a machine where it cannot be built (the engine then
runs the torch backend)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.kernels.attention_metadata import TableRows
from engine.kernels.cpu import attention
from engine.kernels.registry import select_backend
from tests.unit.test_kernels import make_cache, run_step

# Long contexts over many shuffled blocks, decodes and short chunks, and a long chunk apart.
MIXED_STEP = [(300, 1), (5, 1), (700, 1), (20, 3), (0, 50), (63, 1), (64, 1), (1, 30)]


@pytest.fixture
def two_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every piece on two threads (the kernel's own pool), whatever its size."""
    monkeypatch.setattr(attention, "PARALLEL_KEYS", 1)
    attention.set_max_threads(2)
    yield
    attention.set_max_threads(0)


@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_tokens_split_across_the_pool_attend_like_the_reference(
    two_threads: None, head_dim: int
) -> None:
    run_step(MIXED_STEP, seed=3, heads=8, kv_heads=2, backend="cpu", head_dim=head_dim)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("start", [300, 1020])
def test_a_chunks_tokens_attend_bit_for_bit_as_each_would_alone(threads: int, start: int) -> None:
    """The kernel takes a chunk's consecutive tokens as one run, block by block, and a context
    over 256 keys in parts (1020: the chunk's last token alone reaches a fifth part); each
    token's output must still be the bits it gets alone, as a decode token: a speculative
    step's verification then equals the steps it replaces (greedy output identical)."""
    kernels = select_backend("cpu", "cpu")
    heads, kv_heads, head_dim, new = 9, 3, 64, 5  # the default model's head shape
    cache = make_cache(kv_heads=kv_heads, head_dim=head_dim)
    generator = torch.Generator().manual_seed(7)
    table = torch.randperm(cache.num_blocks, generator=generator)[: -(-(start + new) // 4)]
    k, v = (torch.randn(start + new, kv_heads, head_dim, generator=generator) for _ in "kv")
    q = torch.randn(new, heads, head_dim, generator=generator)
    cache.write(
        0, table[torch.arange(start) // 4] * 4 + torch.arange(start) % 4, k[:start], v[:start]
    )

    def step(first: int, count: int) -> torch.Tensor:
        meta = kernels.build_attention_metadata(
            [count],
            [first],
            [table.tolist()],
            cache=cache,
            queries_per_kv=heads // kv_heads,
            device=torch.device("cpu"),
        )
        rows = slice(first - start, first - start + count)
        return kernels.paged_attention(q[rows], k[rows], v[rows], cache, 0, meta, head_dim**-0.5)

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = step(start, new)
        alone = torch.cat([step(start + t, 1) for t in range(new)])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together, alone)


def test_large_pieces_use_every_core_of_the_rank_small_ones_one() -> None:
    def piece(keys: int) -> TableRows:
        empty = torch.zeros(0, dtype=torch.int64)
        return TableRows(None, empty, empty, empty, keys)

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # a small step's matmuls: one core left to the other actors
        attention.set_max_threads(4)
        assert attention.kernel_threads(piece(attention.PARALLEL_KEYS)) == 4
        assert attention.kernel_threads(piece(attention.PARALLEL_KEYS - 1)) == 1
        attention.set_max_threads(0)  # not told: torch's count
        assert attention.kernel_threads(piece(attention.PARALLEL_KEYS)) == 1
    finally:
        attention.set_max_threads(0)
        torch.set_num_threads(before)


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_install_step_builds_the_library_into_the_engine_home(tmp_path: Path) -> None:
    done = run_python(
        "import runpy; runpy.run_module('engine.kernels.cpu.build', run_name='__main__')",
        ENGINE_HOME=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    built = Path(done.stdout.strip())
    assert built.parent == tmp_path / "kernels" and built.is_file()
    assert not list(built.parent.glob(".build-*"))  # no staging file left behind


@pytest.mark.parametrize(
    ("compiler", "reason"),
    [("/nonexistent/c++", "C++ compiler '/nonexistent/c++' not found"), ("false", "failed")],
)
def test_without_a_working_compiler_the_cpu_runs_the_torch_backend(
    tmp_path: Path, compiler: str, reason: str
) -> None:
    done = run_python(
        "from engine.kernels.registry import select_backend\n"
        "print(select_backend('cpu').name)\n"
        "try:\n"
        "    select_backend('cpu', 'cpu')\n"
        "except ValueError as exc:\n"
        "    print(exc)\n",
        ENGINE_HOME=str(tmp_path),
        CXX=compiler,
    )
    assert done.returncode == 0, done.stderr
    chosen, refusal = done.stdout.strip().splitlines()
    assert chosen == "torch"
    assert "kernel backend 'cpu' is unavailable" in refusal and reason in refusal
    assert reason in done.stderr  # the fallback is logged, naming why


def test_extra_compiler_flags_name_a_library_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An AVX2 copy of the kernels (-mno-avx512f) never takes the native library's place.
    from engine.kernels.cpu import build

    monkeypatch.setenv("ENGINE_HOME", str(tmp_path))
    monkeypatch.delenv(build.EXTRA_FLAGS_VARIABLE, raising=False)
    native = build.library_path()
    monkeypatch.setenv(build.EXTRA_FLAGS_VARIABLE, " -mno-avx512f  -DX='a b'")
    assert build.extra_flags() == ("-mno-avx512f", "-DX=a b")
    assert build.library_path().parent == native.parent and build.library_path() != native
