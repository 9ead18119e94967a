"""A quiet tenant beside a flooder (issue 49): its latency alone, with fair share, without.

    python tools/bench/tenants.py                      # the default model, 3 rounds
    python tools/bench/tenants.py --llama-server PATH  # and llama-server under the same load

One engine server with a tenants file of two tenants of weight 1, "quiet" and "flood". The
quiet client sends one request at a time (--quiet-prompt tokens, --quiet-output tokens); the
flooder keeps --flood-streams streams of long prompts going (--flood-prompt, --flood-output).
Phases, alternated round by round so that a shared machine's drift falls on all of them:
  alone     the quiet client alone;
  fair      beside the flooder, who sends with its own key (fair share between the two);
  one key   beside the flooder, who sends with the quiet client's key (one tenant: what a
            server without tenants does).
With --llama-server, llama-server (-np slots for the flooder's streams and the quiet one) serves
the same file under the same load, alone and flooded (it has no tenants). Prompts are random
token ids (no prefix-cache hits), greedy, EOS ignored.

Printed per server and phase: the quiet client's TTFT p50 / p99, its decode tokens/s p50, and
the flooder's output tokens/s while the quiet client ran. Figures of one run compare; absolute
figures drift on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec

if __package__ in (None, ""):  # run as a script: make `engine` and `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.client.process import free_port
from engine.client.servers import engine_running, http_server
from engine.tenants.table import key_digest

KEYS = {"quiet": "sk-bench-quiet", "flood": "sk-bench-flood"}


@dataclass
class Figures:
    """One phase's measures, over every round."""

    ttft: list[float] = field(default_factory=list)
    decode_rate: list[float] = field(default_factory=list)
    flood_tokens: int = 0
    flood_seconds: float = 0.0


async def stream(
    http: httpx.AsyncClient, key: str | None, prompt: list[int], max_tokens: int
) -> list[float]:
    """One streamed completion; the time each token's chunk arrived."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    times: list[float] = []
    async with http.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            raise SystemExit(f"bench tenants: {resp.status_code} {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = msgspec.json.decode(line[6:])
                if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                    times.append(time.perf_counter())
    return times


async def flood(
    http: httpx.AsyncClient,
    key: str | None,
    args: argparse.Namespace,
    rng: random.Random,
    counted: list[int],
) -> None:
    while True:
        prompt = [rng.randrange(100, args.vocab) for _ in range(args.flood_prompt)]
        counted[0] += len(await stream(http, key, prompt, args.flood_output))


async def phase(
    url: str,
    quiet_key: str | None,
    flood_key: str | bool | None,
    args: argparse.Namespace,
    figures: Figures,
    seed: int,
) -> None:
    """The quiet client's requests, beside the flooder unless `flood_key` is False."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=args.flood_streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits) as http:
        counted = [0]
        flooders = []
        if flood_key is not False:
            key = flood_key if isinstance(flood_key, str) else None
            flooders = [
                asyncio.create_task(flood(http, key, args, random.Random(seed * 100 + i), counted))
                for i in range(args.flood_streams)
            ]
            await asyncio.sleep(args.flood_lead)  # the flooder's streams fill the server first
        began, flood_before = time.perf_counter(), counted[0]
        for _ in range(args.quiet_requests):
            prompt = [rng.randrange(100, args.vocab) for _ in range(args.quiet_prompt)]
            sent = time.perf_counter()
            times = await stream(http, quiet_key, prompt, args.quiet_output)
            figures.ttft.append(times[0] - sent)
            figures.decode_rate.append((len(times) - 1) / (times[-1] - times[0]))
        figures.flood_tokens += counted[0] - flood_before
        figures.flood_seconds += time.perf_counter() - began
        for task in flooders:
            task.cancel()
        await asyncio.gather(*flooders, return_exceptions=True)


def tenants_file(directory: Path) -> Path:
    path = directory / "tenants.toml"
    path.write_text(
        "".join(
            f'[tenants.{name}]\nkey_sha256 = "{key_digest(key)}"\n' for name, key in KEYS.items()
        )
    )
    path.chmod(0o600)
    return path


@contextlib.contextmanager
def engine(args: argparse.Namespace, logs: Path) -> Iterator[str]:
    model = [] if args.model is None else [args.model]
    command = [
        "serve",
        *model,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--api-keys-file",
        str(tenants_file(logs)),
        "--max-num-seqs",
        str(args.flood_streams + 4),
        *args.engine_args.split(),
    ]
    with engine_running(command, logs / "engine.log", timeout=600.0) as server:
        yield server.url


@contextlib.contextmanager
def llama_server(args: argparse.Namespace, logs: Path) -> Iterator[str]:
    from engine.launch.model_source import default_model_file
    from tools.peers.llamacpp_peer import THREADS, peer_environment

    slots = args.flood_streams + 1
    context = slots * (args.flood_prompt + args.flood_output + 16)
    model = args.model or str(default_model_file())
    cmd = [
        args.llama_server,
        "-m",
        model,
        "-t",
        str(THREADS),
        "-np",
        str(slots),
        "-c",
        str(context),
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
    ]
    with http_server(
        cmd, "llama-server", logs / "llama-server.log", "/health", 600.0, peer_environment(), 30.0
    ) as url:
        yield url


def run(args: argparse.Namespace) -> dict[str, Figures]:
    logs = Path(tempfile.mkdtemp(prefix="bench-tenants-"))
    results: dict[str, Figures] = {}
    phases: dict[str, tuple[str, str | bool]] = {
        "engine alone": (KEYS["quiet"], False),
        "engine fair": (KEYS["quiet"], KEYS["flood"]),
        "engine one key": (KEYS["quiet"], KEYS["quiet"]),
    }
    with engine(args, logs) as url:
        asyncio.run(phase(url, KEYS["quiet"], False, args, Figures(), 0))  # warm-up
        for round_ in range(args.rounds):
            for number, (name, (quiet, flooder)) in enumerate(phases.items()):
                figures = results.setdefault(name, Figures())
                # Prompts of their own for each phase: none hits what another one cached.
                seed = 1 + round_ * len(phases) + number
                asyncio.run(phase(url, quiet, flooder, args, figures, seed))
    if args.llama_server:
        with llama_server(args, logs) as url:
            asyncio.run(phase(url, None, False, args, Figures(), 0))
            for round_ in range(args.rounds):
                for number, name in enumerate(("llama-server alone", "llama-server")):
                    figures = results.setdefault(name, Figures())
                    seed = 1 + round_ * 2 + number
                    asyncio.run(phase(url, None, number == 1, args, figures, seed))
    return results


def report(results: dict[str, Figures]) -> None:
    print(
        f"{'server / phase':<20} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'tok/s p50':>10} "
        f"{'flood tok/s':>12}"
    )
    for name, figures in results.items():
        ttft = sorted(figures.ttft)
        p99 = ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))]
        rate = statistics.median(figures.decode_rate)
        flood_rate = figures.flood_tokens / figures.flood_seconds if figures.flood_tokens else 0
        print(
            f"{name:<20} {statistics.median(ttft) * 1e3:12.1f} {p99 * 1e3:12.1f} "
            f"{rate:10.1f} {flood_rate:12.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="what the engine serves (default: the default model)")
    parser.add_argument("--engine-args", default="", help="more flags for engine serve")
    parser.add_argument("--llama-server", help="a llama-server binary: measure it too")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quiet-requests", type=int, default=6, help="per phase and round")
    parser.add_argument("--quiet-prompt", type=int, default=128)
    parser.add_argument("--quiet-output", type=int, default=32)
    parser.add_argument("--flood-streams", type=int, default=16)
    parser.add_argument("--flood-prompt", type=int, default=1024)
    parser.add_argument("--flood-output", type=int, default=32)
    parser.add_argument("--flood-lead", type=float, default=3.0, help="seconds before the quiet")
    parser.add_argument("--vocab", type=int, default=30000, help="prompt ids drawn below it")
    args = parser.parse_args()
    report(run(args))


if __name__ == "__main__":
    main()
