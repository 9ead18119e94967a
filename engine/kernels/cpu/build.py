"""Build the CPU kernels' shared library with the system's C++ compiler, once per source and
machine, and load it through ctypes.

The library lands in $ENGINE_HOME/kernels (default ~/.cache/engine/kernels) under a name that
hashes the sources, the compiler flags and this CPU's instruction-set flags (-march=native:
a home shared by machines of different CPUs gets one build per CPU kind). Processes that build
at the same time each compile to a temporary file and rename it into place, so a reader never
sees a half-written library. `make` builds it during installation
(`python -m engine.kernels.cpu.build`); a process that finds none builds it on first use.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.settings.home import check_home_path, default_engine_home

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = (
    HERE / "paged_attention.cpp",
    HERE / "kv_store.cpp",
    HERE / "pointwise.cpp",
    HERE / "linear.cpp",
    HERE / "bf16_linear.cpp",
    HERE / "quantized_linear.cpp",
    HERE / "quant_avx2.cpp",
    HERE / "quant_vnni.cpp",
    HERE / "decode_step.cpp",
)
HEADERS = (
    HERE / "cpu_vector.h",
    HERE / "kv_rows.h",
    HERE / "thread_pool.h",
    HERE / "bf16_tiles.h",
    HERE / "quant_formats.h",
    HERE / "quant_activations.h",
    HERE / "quant_tile_avx2.h",
    HERE / "quant_tile_avx512.h",
    HERE / "quant_tiles.h",
)
COMPILE_FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp-simd",
    "-ffp-contract=fast",
    "-std=c++17",
    "-fPIC",
    "-pthread",
)
FLAGS = (*COMPILE_FLAGS, "-shared")
BUILD_TIMEOUT_S = 300.0
# More compiler flags, part of the library's name: "-mno-avx512f" builds this CPU's kernels as an
# AVX2 machine's (-march=native's vector code without AVX-512, the quantized kernel's best path
# then AVX2), to measure or test that path on an AVX-512 machine.
EXTRA_FLAGS_VARIABLE = "ENGINE_KERNEL_FLAGS"


def extra_flags() -> tuple[str, ...]:
    return tuple(shlex.split(os.environ.get(EXTRA_FLAGS_VARIABLE, "")))


class KernelBuildError(RuntimeError):
    """The library could not be built or loaded; the message says why, in one line."""


def compiler() -> str | None:
    """The C++ compiler to use ($CXX, else c++ or g++ on PATH), or None."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def library_path() -> Path:
    home = default_engine_home()
    digest = hashlib.sha256()
    for part in (*SOURCES, *HEADERS):
        digest.update(part.read_bytes())
    digest.update(" ".join((*FLAGS, *extra_flags())).encode())
    digest.update(_cpu_flags().encode())
    return home / "kernels" / f"cpu_kernels-{digest.hexdigest()[:16]}.so"


def _cpu_flags() -> str:
    """This CPU's instruction-set flags (Linux), the part of -march=native a build depends on."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return ""


def build(target: Path) -> None:
    """Compile SOURCES into `target` (atomically replaced), each source on a core of its own
    where there are several (the quantized kernel's paths are sources apart: most of a build).
    Raises KernelBuildError."""
    cxx = compiler()
    if cxx is None:
        raise KernelBuildError("no C++ compiler found ($CXX, c++ or g++)")
    if shutil.which(cxx) is None:
        raise KernelBuildError(f"C++ compiler {cxx!r} not found")
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    staging = work / target.name
    try:
        objects = [work / f"{source.stem}.o" for source in SOURCES]
        compiles = [
            [cxx, *COMPILE_FLAGS, *extra_flags(), "-c", "-o", str(o), str(source)]
            for source, o in zip(SOURCES, objects, strict=True)
        ]
        _run_all(cxx, compiles, parallel=os.cpu_count() or 1)
        link = [cxx, *FLAGS, *extra_flags(), "-o", str(staging), *map(str, objects)]
        _run_all(cxx, [link], parallel=1)
        os.chmod(staging, 0o755)
        os.replace(staging, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_all(cxx: str, commands: list[list[str]], parallel: int) -> None:
    """Run the compiler's `commands`, `parallel` at a time, within BUILD_TIMEOUT_S in all."""
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    pending = list(commands)
    running: list[subprocess.Popen[str]] = []
    try:
        while pending or running:
            while pending and len(running) < parallel:
                running.append(
                    subprocess.Popen(
                        pending.pop(0), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                    )
                )
            process = running.pop(0)
            try:
                _, stderr = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as exc:
                raise KernelBuildError(
                    f"{cxx} took over {BUILD_TIMEOUT_S:.0f} s on the CPU kernels"
                ) from exc
            if process.returncode != 0:
                last = (stderr.strip().splitlines() or ["(no output)"])[-1]
                raise KernelBuildError(
                    f"{cxx} failed to build the CPU kernels ({process.returncode}): {last}"
                )
    finally:
        for process in running:
            process.kill()
            process.wait()


i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
# Each exported function's argument types (each returns an int status, but for _RESULTS's).
_SIGNATURES: dict[str, list[type[Any]]] = {
    # engine/kernels/cpu/paged_attention.cpp
    "engine_paged_attention": [
        ctypes.c_int,  # dtype of the query and the output
        ctypes.c_int,  # dtype of the cache's rows (kv_rows.h)
        ptr,  # query
        i64,  # query token stride
        ptr,  # key cache
        ptr,  # value cache
        ptr,  # block tables
        i64,  # table width
        ptr,  # token -> block table row
        ptr,  # keys seen per token
        ptr,  # step row per token, or null
        i64,  # tokens
        i64,  # heads
        i64,  # kv heads
        i64,  # head dim
        i64,  # block size
        ctypes.c_float,  # scale
        ptr,  # out
        ctypes.c_int,  # threads
    ],
    "engine_paged_attention_variant": [
        ctypes.c_int,  # dtype of the query and the output
        ctypes.c_int,  # dtype of the cache's rows (kv_rows.h)
        ptr,  # query
        i64,  # query token stride
        ptr,  # key cache
        ptr,  # value cache
        ptr,  # block tables
        i64,  # table width
        ptr,  # token -> block table row
        ptr,  # keys seen per token
        ptr,  # step row per token, or null
        i64,  # tokens
        i64,  # heads
        i64,  # kv heads
        i64,  # head dim
        i64,  # block size
        ctypes.c_float,  # scale
        ptr,  # out
        ctypes.c_int,  # threads
        i64,  # sliding window (0: none)
        ctypes.c_float,  # soft cap (0: none)
    ],
    # engine/kernels/cpu/kv_store.cpp: dtype, src, token stride, tokens, int64 slots, cache dtype,
    # cache, kv heads, head dim
    "engine_kv_store": [ctypes.c_int, ptr, i64, i64, ptr, ctypes.c_int, ptr, i64, i64],
    # engine/kernels/cpu/pointwise.cpp; x and out point at activations, all of one dtype.
    # dtype, x, token stride, tokens, heads, dim, weight, weight head stride, eps, out
    "engine_rms_norm": [ctypes.c_int, ptr, i64, i64, i64, i64, ptr, i64, ctypes.c_float, ptr],
    # dtype, x, token stride, tokens, heads, dim, cos, sin, out
    "engine_rotary": [ctypes.c_int, ptr, i64, i64, i64, i64, ptr, ptr, ptr],
    # dtype, gate_up, tokens, width, out
    "engine_silu_and_mul": [ctypes.c_int, ptr, i64, i64, ptr],
    # float32 x, rows, columns, row stride, int64 out
    "engine_argmax_rows": [ptr, i64, i64, i64, ptr],
    # engine/kernels/cpu/linear.cpp, float32: x, m, k, x row stride, packed w, n, bias or
    # null, out, threads
    "engine_linear": [ptr, i64, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int],
    # engine/kernels/cpu/bf16_linear.cpp: x dtype, x, m, k, x row stride, packed w, n, float32
    # bias or null, out dtype, out, threads, path
    "engine_bf16_linear": [i32, ptr, i64, i64, i64, ptr, i64, ptr, i32, ptr, i32, i32],
    # (no arguments) -> bit p set where path p runs
    "engine_bf16_linear_paths": [],
    # (no arguments) -> the path a call asking for none takes
    "engine_bf16_linear_best": [],
    # path (0: the fastest) -> 0, or 2 where this CPU cannot run it
    "engine_bf16_linear_choose": [i32],
    # engine/kernels/cpu/quantized_linear.cpp: float32 x, m, k, x row stride, the weight's
    # parts (quantized.CPart array, engine/quantization/layout.py), part count, n, bias or null,
    # out, threads, path
    "engine_quantized_linear": [ptr, i64, i64, i64, ptr, i64, i64, ptr, ptr, i32, i32],
    # one part, k, int64 ids, count, float32 out [count, k]
    "engine_quantized_rows": [ptr, i64, ptr, i64, ptr],
    # format id, rows, k -> bytes (int64; -1 for a bad format or k)
    "engine_quantized_bytes": [i64, i64, i64],
    # (no arguments) -> bit p set where path p runs
    "engine_quantized_paths": [],
    # engine/kernels/cpu/decode_step.cpp: dtype of h, layers (the structs of
    # engine/model/architectures/fused_decode.py), count, shape, step, h [m, hidden] in place, m
    "engine_decode_layers": [i32, ptr, i64, ptr, ptr, ptr, i64],
}


_RESULTS: dict[str, type[Any]] = {"engine_quantized_bytes": i64}


@functools.cache
def load_library() -> ctypes.CDLL:
    """The built library with its functions' signatures declared; built first if missing."""
    target = library_path()
    if not target.is_file():
        log.info("building the CPU kernels (once) into %s", target)
        build(target)
    try:  # a library another user could have written would run their code in ours
        check_home_path(target, default_engine_home())
    except OSError as exc:  # ForeignFileError among them
        raise KernelBuildError(f"not loading the CPU kernels: {exc}") from None
    try:
        library = ctypes.CDLL(str(target))
    except OSError as exc:
        raise KernelBuildError(f"cannot load {target}: {exc}") from exc
    for name, argtypes in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes = argtypes
        function.restype = _RESULTS.get(name, ctypes.c_int)
    return library


if __name__ == "__main__":  # the install step: build now rather than at first use
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(load_library()._name)
    except KernelBuildError as exc:
        # Not fatal: the engine then runs the torch backend on the CPU.
        print(f"CPU attention kernel not built: {exc}", file=sys.stderr)
