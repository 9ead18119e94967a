"""What the front door costs per request, API by API: this checkout's server beside another
checkout's (a worktree of an older commit), the same workload against both.

    python tools/bench/front_door.py --peer-checkout ../engine-before [--model demo] \\
        --requests 64 --rounds 4 --concurrency 8 --output-len 16

Both servers start side by side with the same settings, each from its own checkout (its
`python -m engine` imports that checkout's package). Each round sends every API's workload
(completions, chat completions, /v1/responses, /v1/messages; whole and streamed) to both, in
alternating order, so drift on a busy machine hits both alike. Greedy requests; the completions
and chat ones ignore EOS. Per API and side: median requests/s, and CPU milliseconds the
server's root process (HTTP, the registry of requests in flight) spent per request, read from
/proc. The ratio columns are this checkout / the peer: < 1 CPU means cheaper.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.client.servers import engine_running

ROOT = Path(__file__).resolve().parents[2]

# The prompts' words: a sentence, cycled through
SENTENCE = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum"
WORDS = SENTENCE.split()


@dataclass
class Side:
    name: str
    pid: int
    url: str
    # by API: per round
    rates: dict[str, list[float]] = field(default_factory=dict)
    cpu_ms: dict[str, list[float]] = field(default_factory=dict)


@contextlib.contextmanager
def serving(name: str, checkout: Path, args: argparse.Namespace, work: Path) -> Iterator[Side]:
    """`engine serve` from `checkout` (its package first on the path), stopped on leaving."""
    command = ["serve", "--host", "127.0.0.1", "--port", "0", "--max-model-len", "1024"]
    command += ["--max-num-seqs", str(args.concurrency), "--kv-cache-memory", "64MiB"]
    command += ["--model", args.model] if args.model else []
    env = {"PYTHONPATH": str(checkout)}
    log = work / f"{name}.log"
    with engine_running(command, log, env, cwd=checkout, timeout=args.start_timeout) as server:
        yield Side(name, server.pid, server.url)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bodies(prompt: str, model: str, out: int, stream: bool) -> dict[str, tuple[str, Any]]:
    """API → (path, body) of one greedy request of `out` tokens."""
    greedy = {"temperature": 0.0, "stream": stream}
    chat = [{"role": "user", "content": prompt}]
    exact = {"max_tokens": out, "ignore_eos": True, **greedy}
    messages = {"model": model, "messages": chat, "max_tokens": out, **greedy}
    return {
        "completions": ("/v1/completions", {"prompt": prompt, **exact}),
        "chat": ("/v1/chat/completions", {"messages": chat, **exact}),
        "responses": ("/v1/responses", {"input": prompt, "max_output_tokens": out, **greedy}),
        "messages": ("/v1/messages", messages),
    }


async def one(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> None:
    if not body["stream"]:
        (await client.post(path, json=body)).raise_for_status()
        return
    async with client.stream("POST", path, json=body) as answer:
        answer.raise_for_status()
        async for _ in answer.aiter_bytes():
            pass


async def run_api(side: Side, requests: list[tuple[str, Any]], width: int) -> float:
    """Requests/s of `requests` sent `width` at a time."""
    queue = list(requests)
    limits = httpx.Limits(max_connections=width)
    async with httpx.AsyncClient(base_url=side.url, timeout=600, limits=limits) as client:

        async def worker() -> None:
            while queue:
                await one(client, *queue.pop())

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(width)))
        return len(requests) / (time.perf_counter() - began)


def workloads(args: argparse.Namespace, model: str) -> dict[str, list[tuple[str, Any]]]:
    out: dict[str, list[tuple[str, Any]]] = {}
    for stream in (False, True):
        for i in range(args.requests):
            words = [WORDS[(i * 7 + k) % len(WORDS)] for k in range(args.input_words)]
            for api, request in bodies(" ".join(words), model, args.output_len, stream).items():
                name = api + (" stream" if stream else "")
                if not args.apis or name in args.apis:
                    out.setdefault(name, []).append(request)
    return out


def measure(side: Side, api: str, requests: list[Any], width: int) -> None:
    before = cpu_seconds(side.pid)
    rate = asyncio.run(run_api(side, requests, width))
    used = cpu_seconds(side.pid) - before
    side.rates.setdefault(api, []).append(rate)
    side.cpu_ms.setdefault(api, []).append(used / len(requests) * 1000)


def report(ours: Side, peer: Side, args: argparse.Namespace) -> None:
    print(
        f"{args.requests} requests per API x {args.rounds} rounds, {args.input_words} words in, "
        f"{args.output_len} tokens out, {args.concurrency} in flight; "
        f"model {args.model or 'default'}"
    )
    heads = ("API", "req/s ours", "peer", "ratio", "root CPU ms/req ours", "peer", "ratio")
    print(
        f"{heads[0]:20}"
        + "".join(f"{h:>{w}}" for h, w in zip(heads[1:], (11, 8, 7, 22, 8, 7), strict=True))
    )
    median: Callable[[list[float]], float] = statistics.median
    for api in ours.rates:
        a, b = median(ours.rates[api]), median(peer.rates[api])
        c, d = median(ours.cpu_ms[api]), median(peer.cpu_ms[api])
        print(f"{api:20}{a:11.1f}{b:8.1f}{a / b:7.3f}{c:22.2f}{d:8.2f}{c / d:7.3f}")
    for side in (ours, peer):
        for api in side.cpu_ms:
            rounds = ", ".join(f"{v:.2f}" for v in side.cpu_ms[api])
            print(f"  {side.name} {api}: root CPU ms/req per round {rounds}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer-checkout", type=Path, required=True, help="the other checkout")
    parser.add_argument("--model", help="as --model of `engine serve` (default: the default model)")
    parser.add_argument("--requests", type=int, default=64, help="per API and round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--input-words", type=int, default=24)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument(
        "--apis",
        type=lambda text: text.split(","),
        default=[],
        help="only these, comma-separated (e.g. 'chat,responses stream'; default: all eight)",
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="front-door-"))
    with (
        serving("ours", ROOT, args, work) as ours,
        serving("peer", args.peer_checkout.resolve(), args, work) as peer,
    ):
        model = httpx.get(ours.url + "/v1/models").json()["data"][0]["id"]
        loads = workloads(args, model)
        for side in (ours, peer):  # unmeasured: a model loaded on demand is loaded by now
            for requests in loads.values():
                asyncio.run(run_api(side, requests[:1], 1))
        for round_number in range(args.rounds):
            for api, requests in loads.items():
                order = [ours, peer] if round_number % 2 == 0 else [peer, ours]
                for side in order:
                    measure(side, api, requests, args.concurrency)
            print(f"round {round_number + 1}/{args.rounds} done", file=sys.stderr)
    report(ours, peer, args)


if __name__ == "__main__":
    main()
