"""Many models in one server (issue 48): what loading on demand costs, and what routing costs.

1. Time to first token of a request to a model that is not loaded, served from a --models-dir:
   with its files cold (dropped from the page cache with posix_fadvise, the GGUF file and what
   the engine derived from it under $ENGINE_HOME/gguf/) and warm (unloaded a moment ago), in
   rounds alternating with a one-model server's time from its start to the same first token
   (files cold), and beside llama-server's time from its start to the first token of the same
   request on the same file (where $ENGINE_HOME/peers holds it: tools/peers/llamacpp_peer.py
   builds it).
2. The routing layer's cost on a loaded model's throughput: the model served alone (--model)
   and the same model served from a catalogue with two more models loaded and idle, closed-loop
   streams of greedy completions against each in alternating rounds; output tokens/s, the
   server's CPU seconds per output token (every process of it), the root's CPU per request, and
   the ratios.

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
    """Alternating rounds: a catalogue's load of `model` on its first request, files cold then
    warm, and a one-model server (--model) from its start to the same request's first token,
    files cold."""
    directory = Path(tempfile.mkdtemp(prefix="models-", dir=logs))
    (directory / model.name).symlink_to(model)
    name = model.stem
    derived = default_engine_home() / "gguf"
    found: dict[str, list[float]] = {"cold": [], "warm": [], "one-model server": []}
    args = ["serve", "--models-dir", str(directory), *ARGS]
    with engine_running(args, logs / "catalogue.log") as server:
        for _ in range(rounds):
            for kind in ("cold", "warm"):
                if kind == "cold":
                    drop_from_page_cache([model, derived])
                found[kind].append(first_token_seconds(server.url, name))
                httpx.post(f"{server.url}/models/unload", json={"model": name}, timeout=300)
            drop_from_page_cache([model, derived])
            found["one-model server"].append(one_model_server_seconds(model, logs))
    return found


def one_model_server_seconds(model: Path, logs: Path) -> float:
    """`engine serve --model` from its start to the first token of the same request."""
    began = time.perf_counter()
    args = ["serve", "--model", str(model), "--served-model-name", "alone", *ARGS]
    with engine_running(args, logs / "alone-start.log") as server:
        first_token_seconds(server.url, "alone")
        return time.perf_counter() - began


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


def cpu_figures(url: str, model: str) -> dict[str, float]:
    """From /metrics: the root process's CPU seconds (where the routing layer lives), every
    actor's of every model with the root's (each model's stats repeat the root: counted once),
    and `model`'s HTTP requests."""
    found = {"root": 0.0, "all": 0.0, "requests": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=60).text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "engine:actor_cpu_seconds_total":
                if labels["actor"] == "root" and labels["model_name"] == model:
                    found["root"] = sample.value
                if labels["actor"] != "root":
                    found["all"] += sample.value
            elif sample.name == "engine:http_requests_total" and labels["model_name"] == model:
                found["requests"] += sample.value
    found["all"] += found["root"]
    return found


def output_tokens(url: str, model: str, streams: int, seconds: float) -> tuple[int, float]:
    """Closed-loop greedy completions for `seconds`: (output tokens, seconds taken)."""
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
    return total, time.perf_counter() - began


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
    """Alternating rounds against the model alone and routed (two more models loaded, idle):
    output tokens/s (wall clock: at the machine's mercy when it is shared), and the CPU seconds
    the whole server (root, every model's actors) spent per output token, which other users of
    the machine disturb far less."""
    alone_args = ["serve", "--model", str(model), "--served-model-name", "target", *ARGS]
    figures: dict[str, dict[str, list[float]]] = {
        name: {"tokens/s": [], "CPU ms/token": [], "root CPU ms/request": []}
        for name in ("alone", "routed")
    }
    with (
        engine_running(alone_args, logs / "alone.log") as alone,
        catalogue_with_others(model, logs) as routed,
    ):
        servers = {"alone": alone.url, "routed": routed}
        for url in servers.values():  # warm both up
            output_tokens(url, "target", streams, 3.0)
        for _ in range(rounds):
            for name, url in servers.items():
                before = cpu_figures(url, "target")
                tokens, took = output_tokens(url, "target", streams, seconds)
                after = cpu_figures(url, "target")
                requests = max(after["requests"] - before["requests"], 1.0)
                figures[name]["tokens/s"].append(tokens / took)
                figures[name]["CPU ms/token"].append(1000 * (after["all"] - before["all"]) / tokens)
                root = after["root"] - before["root"]
                figures[name]["root CPU ms/request"].append(1000 * root / requests)
    print(
        f"{streams} streams of greedy completions, alternating rounds of {seconds:.0f} s; "
        "routed: 2 more models loaded and idle"
    )
    for what in ("tokens/s", "CPU ms/token", "root CPU ms/request"):
        for name in ("alone", "routed"):
            print(f"  {what}, {name}: {', '.join(f'{x:.2f}' for x in figures[name][what])}")
        pairs = zip(figures["alone"][what], figures["routed"][what], strict=True)
        ratios = [routed / alone for alone, routed in pairs]
        shown = ", ".join(f"{x:.3f}" for x in ratios)
        print(f"  {what}, routed / alone: {shown}; median {statistics.median(ratios):.3f}")


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
        print(f"engine TTFT, model not loaded, {kind}: {', '.join(f'{t:.2f}' for t in found)} s")
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
