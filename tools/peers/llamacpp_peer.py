"""llama.cpp as a peer (docs/benchmarks.md, Peers): its binaries built once from the llama.cpp
vendored in the `llama-cpp-python` source distribution, and `llama-server` started and stopped
around a run.

    python tools/peers/llamacpp_peer.py build                    # prints the binaries' directory
    python tools/peers/llamacpp_peer.py serve --parallel 16      # until Ctrl-C
    python tools/peers/llamacpp_peer.py bench                    # llama-bench pp256 / tg128, JSON
    python tools/peers/llamacpp_peer.py build --extra            # also llama-perplexity

`llama_cpp.server` (the Python package's own server) serves one request at a time and is not a
fair peer; `llama-server` with `-np N` batches N streams. The build (CMake, `GGML_NATIVE=ON`,
static, Release; `llama-server`, `llama-bench`, `llama-tokenize`, `llama-quantize`, and the
EXTRA_TARGETS, `llama-perplexity`; without AMX, see CMAKE_FLAGS) takes minutes on two cores and
lands in $ENGINE_HOME/peers/llama.cpp-VERSION-bBUILD/bin, renamed into place whole. A directory
built before an extra target was added gets just that binary built (a fresh configure, as the
build directory is not kept) and renamed in beside the others, which are left alone;
`binary(name)` asks for one.
The model is the default model's GGUF file unless --model names another; `f32_file` makes a
file's F32 copy once (for comparisons at float32, beside the engine's float32 export of it).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.client.process import free_port
from engine.client.servers import http_server

LLAMA_CPP_PYTHON = "0.3.36"
TARGETS = ("llama-server", "llama-bench", "llama-tokenize", "llama-quantize")
# Built with TARGETS into a fresh directory, and on their own into one that lacks them.
EXTRA_TARGETS = ("llama-perplexity",)
# Static binaries: the build directory is thrown away, so nothing may point back into it.
# Without ggml's AMX code (its macros undefined, whatever -march=native says): these machines'
# CPUs advertise AMX that their hypervisor does not run (`tilezero` faults: SIGILL in every
# matmul ggml's AMX buffer type takes), and the engine's kernels use none (AVX512-VNNI at most),
# so both sides run on the same instructions.
NO_AMX = "-U__AMX_TILE__ -U__AMX_INT8__ -U__AMX_BF16__"
CMAKE_FLAGS = (
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    f"-DCMAKE_C_FLAGS={NO_AMX}",
    f"-DCMAKE_CXX_FLAGS={NO_AMX}",
)
# Part of the binaries' directory name: bumped when CMAKE_FLAGS change, so a build made with
# other flags is not reused.
BUILD = 2
THREADS = 2


def peer_directory(engine_home: Path | None = None) -> Path:
    from engine.settings.home import default_engine_home

    home = engine_home or default_engine_home()
    return home / "peers" / f"llama.cpp-{LLAMA_CPP_PYTHON}-b{BUILD}"


def binaries(
    engine_home: Path | None = None, sdist: Path | None = None, targets: Sequence[str] = TARGETS
) -> Path:
    """The directory of the built binaries, building them first when they are not there; any of
    `targets` missing from an existing directory is built alone and added to it. The build
    renames its bin/ into the peer's directory, which other tools fill too (quantized/, f32/):
    it never replaces the directory whole."""
    from engine.settings.home import build_directory

    target = peer_directory(engine_home)
    if not (target / "bin" / TARGETS[0]).is_file():
        print(f"llamacpp_peer: building llama.cpp into {target} (minutes)", file=sys.stderr)
        everything = tuple(dict.fromkeys((*TARGETS, *EXTRA_TARGETS, *targets)))
        target.mkdir(parents=True, exist_ok=True)
        build_directory(
            target / "bin", functools.partial(_build, sdist=sdist, targets=everything), TARGETS[0]
        )
    missing = [name for name in targets if not (target / "bin" / name).is_file()]
    if missing:
        _add_binaries(target, missing, sdist)
    return target / "bin"


def binary(name: str, engine_home: Path | None = None, sdist: Path | None = None) -> Path:
    """One binary's path (e.g. "llama-perplexity"), built first when it is not there."""
    return binaries(engine_home, sdist, targets=(name,)) / name


def _add_binaries(target: Path, names: Sequence[str], sdist: Path | None) -> None:
    """Build `names` alone in a staging directory beside `target` and rename each into
    target/bin (the same file system, so a concurrent reader sees the whole file or none)."""
    print(f"llamacpp_peer: building {', '.join(names)} into {target} (minutes)", file=sys.stderr)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=target))
    try:
        _build(staging, sdist, tuple(names))
        for name in names:
            os.rename(staging / name, target / "bin" / name)
        os.replace(staging / "build.log", target / f"build-{'-'.join(names)}.log")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _build(staging: Path, sdist: Path | None, targets: Sequence[str] = TARGETS) -> None:
    """Build `targets` and copy them, with build.log, into `staging` (the bin/ to be)."""
    work = Path(tempfile.mkdtemp(prefix=".work-", dir=staging.parent))
    try:
        _build_in(work, staging, sdist, targets)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _build_in(work: Path, staging: Path, sdist: Path | None, targets: Sequence[str]) -> None:
    archive = sdist or download_sdist(work)
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="data")
    source = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
    build = work / "build"
    log = staging / "build.log"
    with open(log, "w") as out:
        for cmd in (
            ["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS],
            ["cmake", "--build", str(build), "-j2", "--target", *targets],
        ):
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                kept = Path(tempfile.mkdtemp(prefix="llamacpp-build-")) / "build.log"
                shutil.copy(log, kept)
                raise SystemExit(f"llamacpp_peer: `{' '.join(cmd[:3])} ...` failed; log: {kept}")
    for name in targets:
        shutil.copy2(build / "bin" / name, staging / name)


def download_sdist(into: Path) -> Path:
    """The source distribution from PyPI (it has no wheel for this platform, so `pip download`
    without --no-binary would also get it; with it, pip never picks a wheel)."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
        "-d",
        str(into),
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return next(into.glob("llama_cpp_python-*.tar.gz"))


def model_file(model: str | None) -> Path:
    """--model's GGUF file, or the default model's."""
    if model is None:
        from engine.launch.model_source import default_model_file

        return default_model_file()
    path = Path(model).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        raise SystemExit(f"llama.cpp needs a .gguf file, got {model!r}")
    return path


def f32_file(source: Path) -> Path:
    """<stem>.F32.gguf: `source` dequantized to float32 (the weights the engine's float32 export
    of it holds), made once by `llama-quantize --allow-requantize ... F32` under
    peer_directory()/f32, beside quantized/."""
    out_dir = peer_directory() / "f32"
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = source.name.removesuffix(".gguf").rsplit(".", 1)[0]
    target = out_dir / f"{stem}.F32.gguf"
    if not target.is_file():
        partial = target.with_suffix(".partial")
        cmd = [
            str(binary("llama-quantize")),
            "--allow-requantize",
            str(source),
            str(partial),
            "F32",
            str(THREADS),
        ]
        print(f"llamacpp_peer: making {target}", file=sys.stderr)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"llama-quantize failed:\n{(done.stdout + done.stderr)[-3000:]}")
        partial.rename(target)
    return target


@contextlib.contextmanager
def llama_server(
    model: Path, parallel: int, context: int, logs: Path, start_timeout: float = 300.0
) -> Iterator[str]:
    """`llama-server` with `parallel` slots sharing `context` tokens of KV cache, on a free port;
    yields its URL once /health answers 200 (it answers 503 while the model loads)."""
    port = free_port()
    cmd = [
        str(binaries() / "llama-server"),
        "-m",
        str(model),
        "-t",
        str(THREADS),
        "-np",
        str(parallel),
        "-c",
        str(context),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    log_path = logs / "llama-server.log"
    # /health answers 503 while the model loads, 200 once it can serve.
    with http_server(
        cmd, "llama-server", log_path, "/health", start_timeout, peer_environment(), 30.0
    ) as url:
        yield url


def peer_environment() -> dict[str, str]:
    """This environment without OpenMP settings: the engine's processes (and the benchmarks that
    run the model in-process) set OMP_WAIT_POLICY=PASSIVE for themselves, and llama.cpp's OpenMP
    threads, sleeping between its many small ops, would decode several times slower."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}


def llama_bench(model: Path, prompt: int = 256, generate: int = 128) -> dict[str, float]:
    """llama-bench's tokens/s: {"pp": prompt processing of `prompt` tokens, "tg": generation of
    `generate` tokens, one stream}, on THREADS threads."""
    cmd = [
        str(binaries() / "llama-bench"),
        "-m",
        str(model),
        "-t",
        str(THREADS),
        "-p",
        str(prompt),
        "-n",
        str(generate),
        "-o",
        "json",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=peer_environment(), timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"llama-bench failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    rates: dict[str, float] = {}
    for test in json.loads(done.stdout):
        key = "pp" if test["n_prompt"] and not test["n_gen"] else "tg"
        rates[key] = float(test["avg_ts"])
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["build", "serve", "bench"])
    parser.add_argument("--model", help="a .gguf file (default: the default model's)")
    parser.add_argument("--sdist", type=Path, help="build from this llama_cpp_python-*.tar.gz")
    parser.add_argument("--parallel", type=int, default=16, help="serve: llama-server -np")
    parser.add_argument("--context", type=int, default=8192, help="serve: llama-server -c")
    parser.add_argument(
        "--extra", action="store_true", help=f"build: also {', '.join(EXTRA_TARGETS)}"
    )
    args = parser.parse_args()
    targets = (*TARGETS, *EXTRA_TARGETS) if args.extra else TARGETS
    print(binaries(sdist=args.sdist, targets=targets))
    if args.command == "bench":
        print(json.dumps(llama_bench(model_file(args.model))))
    elif args.command == "serve":
        logs = Path(tempfile.mkdtemp(prefix="llama-server-"))
        with llama_server(model_file(args.model), args.parallel, args.context, logs) as url:
            print(f"llama-server ready: {url} (log {logs}); Ctrl-C stops it", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(3600)


if __name__ == "__main__":
    main()
