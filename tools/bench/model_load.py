"""Many models in one server (issue 48): what loading on demand costs, and what routing costs.

1. Time to first token of a request to a model that is not loaded, served from a --models-dir:
   with its files cold (dropped from the page cache with posix_fadvise, the GGUF file and what
   the engine derived from it under $ENGINE_HOME/gguf/) and warm (unloaded a moment ago), beside
   llama-server's time from its start to the first token of the same request on the same file
   (where $ENGINE_HOME/peers holds it: tools/peers/llamacpp_peer.py builds it).
2. The routing layer's cost on a loaded model's throughput: the model served alone (--model)
   and the same model served from a catalogue with two more models loaded and idle, closed-loop
   streams of greedy completions against each in alternating rounds; output tokens/s and the
   ratio.

    .venv/bin/python tools/bench/model_load.py [--model FILE.gguf] [--rounds 3] [--streams 4]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

if __package__ in (None, ""):  # run as a script: make `engine` and `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


from engine.client.process import free_port
from engine.client.servers import ServerFailed, engine_running, http_server
from engine.launch.model_source import default_model_file
from engine.settings.home import default_engine_home
from tools.peers.llamacpp_peer import THREADS, peer_directory, peer_environment

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
ARGS = ["--host", "127.0.0.1", "--port", "0", "--disable-log-stats"]


def first_token_seconds(url: str, model: str, max_tokens: int = 1) -> float:
    """Seconds from sending a streamed completion to its first token's event."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    began = time.perf_counter()
    streamed = body | {"stream": True}
    with (
        httpx.Client(base_url=url, timeout=900) as http,
        http.stream("POST", "/v1/completions", json=streamed) as reply,
    ):
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - began
    raise RuntimeError("no token came")


def drop_from_page_cache(paths: list[Path]) -> None:
    """Evict these files' pages (only theirs: other users' caches stay)."""
    for path in paths:
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for file in files:
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def load_times(model: Path, rounds: int, logs: Path) -> dict[str, list[float]]:
    directory = Path(tempfile.mkdtemp(prefix="models-", dir=logs))
    (directory / model.name).symlink_to(model)
    name = model.stem
    derived = default_engine_home() / "gguf"
    found: dict[str, list[float]] = {"cold": [], "warm": []}
    args = ["serve", "--models-dir", str(directory), *ARGS]
    with engine_running(args, logs / "catalogue.log") as server:
        for _ in range(rounds):
            for kind in ("cold", "warm"):
                if kind == "cold":
                    drop_from_page_cache([model, derived])
                found[kind].append(first_token_seconds(server.url, name))
                httpx.post(f"{server.url}/models/unload", json={"model": name}, timeout=300)
    return found


def llama_server_times(model: Path, binary: Path, rounds: int, logs: Path) -> list[float]:
    """llama-server from its start (file cold) to the first token of the same request."""
    times = []
    for _ in range(rounds):
        drop_from_page_cache([model])
        began = time.perf_counter()
        port = free_port()
        cmd = [str(binary), "-m", str(model), "-t", str(THREADS), "-np", "1", "-c", "4096"]
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
        log = logs / "llama-server.log"
        with http_server(cmd, "llama-server", log, "/health", 300.0, peer_environment(), 30.0):
            first_token_seconds(f"http://127.0.0.1:{port}", model.stem)
            times.append(time.perf_counter() - began)  # the start, the load, the first token
    return times


def llama_server_binary(given: Path | None) -> Path | None:
    """--llama-server, else the peer's build if it is there (never built here: minutes)."""
    if given is not None:
        return given
    for directory in (peer_directory(), peer_directory().with_name("llama.cpp-0.3.36")):
        if (directory / "bin" / "llama-server").is_file():
            return directory / "bin" / "llama-server"
    return None


def root_figures(url: str, model: str) -> tuple[float, float, float]:
    """(the root process's CPU seconds, `model`'s HTTP requests, every other model's actors'
    CPU seconds) from /metrics: the routing layer lives in the root."""
    root = requests = others = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=60).text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "engine:actor_cpu_seconds_total":
                if labels["actor"] == "root" and labels["model_name"] == model:
                    root = sample.value
                elif labels["actor"] != "root" and labels["model_name"] != model:
                    others += sample.value
            elif sample.name == "engine:http_requests_total" and labels["model_name"] == model:
                requests += sample.value
    return root, requests, others


def tokens_per_second(url: str, model: str, streams: int, seconds: float) -> float:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 64, "temperature": 0}
    body["ignore_eos"] = True
    deadline = time.perf_counter() + seconds

    def loop() -> int:
        done = 0
        with httpx.Client(base_url=url, timeout=300) as http:
            while time.perf_counter() < deadline:
                reply = http.post("/v1/completions", json=body)
                done += reply.json()["usage"]["completion_tokens"]
        return done

    began = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        total = sum(pool.map(lambda _: loop(), range(streams)))
    return total / (time.perf_counter() - began)


@contextlib.contextmanager
def catalogue_with_others(model: Path, logs: Path) -> Iterator[str]:
    """`model` in a models directory beside two more models, all three loaded."""
    directory = Path(tempfile.mkdtemp(prefix="routed-", dir=logs))
    for name in ("target", "other-a", "other-b"):
        (directory / f"{name}.gguf").symlink_to(model)
    args = ["serve", "--models-dir", str(directory), "--keep-alive", "-1", *ARGS]
    with engine_running(args, logs / "routed.log") as server:
        for name in ("target", "other-a", "other-b"):
            httpx.post(f"{server.url}/models/load", json={"model": name}, timeout=600)
        yield server.url


def routing_cost(model: Path, rounds: int, streams: int, seconds: float, logs: Path) -> None:
    alone_args = ["serve", "--model", str(model), "--served-model-name", "target", *ARGS]
    alone_rates, routed_rates = [], []
    with (
        engine_running(alone_args, logs / "alone.log") as alone,
        catalogue_with_others(model, logs) as routed,
    ):
        for url in (alone.url, routed):  # warm both up
            tokens_per_second(url, "target", streams, 3.0)
        cpu: dict[str, list[float]] = {"alone": [], "routed": [], "idle models": []}
        for _ in range(rounds):
            for name, url, rates in (
                ("alone", alone.url, alone_rates),
                ("routed", routed, routed_rates),
            ):
                before = root_figures(url, "target")
                rates.append(tokens_per_second(url, "target", streams, seconds))
                after = root_figures(url, "target")
                cpu[name].append((after[0] - before[0]) / max(after[1] - before[1], 1.0))
                if name == "routed":
                    cpu["idle models"].append(after[2] - before[2])
    print("root CPU ms per request (the routing layer's home), alternating rounds:")
    for name in ("alone", "routed"):
        print(f"  {name}: {', '.join(f'{1000 * x:.2f}' for x in cpu[name])}")
    print(f"  the two idle models' actors, CPU s per round: {cpu['idle models']}")
    ratios = [r / a for a, r in zip(alone_rates, routed_rates, strict=True)]
    print(f"output tokens/s, {streams} streams, alternating rounds:")
    print(f"  alone:   {', '.join(f'{x:.1f}' for x in alone_rates)}")
    print(f"  routed:  {', '.join(f'{x:.1f}' for x in routed_rates)} (2 more models loaded)")
    print(f"  routed / alone per round: {', '.join(f'{x:.3f}' for x in ratios)}; "
          f"median {statistics.median(ratios):.3f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a .gguf file (default model)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--skip-routing", action="store_true")
    parser.add_argument("--skip-load", action="store_true")
    parser.add_argument("--llama-server", type=Path, default=None, help="its binary")
    args = parser.parse_args()
    model = (args.model or default_model_file()).resolve()
    logs = Path(tempfile.mkdtemp(prefix="model-load-"))
    print(f"load: {os.getloadavg()[0]:.1f}; model {model.name}")
    times = {} if args.skip_load else load_times(model, args.rounds, logs)
    for kind, found in times.items():
        print(f"engine TTFT, model not loaded, {kind} files: "
              f"{', '.join(f'{t:.2f}' for t in found)} s")  # fmt: skip
    binary = llama_server_binary(args.llama_server)
    if binary is None:
        print("llama-server: not measured (tools/peers/llamacpp_peer.py builds it)")
    elif not args.skip_load:
        try:
            peer = llama_server_times(model, binary, args.rounds, logs)
        except ServerFailed as e:
            print(f"llama-server: not measured: {e}")
        else:
            shown = ", ".join(f"{t:.2f}" for t in peer)
            print(f"llama-server ({binary}) start to first token, cold file: {shown} s")
    if not args.skip_routing:
        routing_cost(model, args.rounds, args.streams, args.seconds, logs)
    shutil.rmtree(logs, ignore_errors=True)


if __name__ == "__main__":
    main()
