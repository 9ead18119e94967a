"""The prefix cache's disk tier (issue 50): time to first token of a long shared prefix after a
restart, read from disk, beside the same length computed (cold) and found in RAM; and what the
tier costs a load whose every prompt misses.

    python tools/bench/kv_disk.py ttft                          # 2,000 / 4,000 / 8,000 tokens
    python tools/bench/kv_disk.py ttft --tokens 4000 --rounds 4 --model PATH
    python tools/bench/kv_disk.py miss --prompts 8 --tokens 1000 --rounds 4

`ttft`: each round starts `python -m engine` afresh on one tier directory (the restart) and, for
each length, measures in turn (the order of the first two flips every round):
  - disk, page cache dropped: a prompt the previous round's server served (its block files
    written, then dropped from the page cache with posix_fadvise, as after a host restart),
  - cold: a prompt of fresh random tokens, never seen,
  - disk, page cache warm: another prompt of the previous round (as after a root restart),
  - RAM: the cold prompt again (the prefix cache in RAM).
A request is its prompt's token ids and one token to sample (max_tokens 1), so its time is the
time to first token as the client sees it; a short warm-up request goes first after each start.
Each length's line gives the medians and the ratios to cold (from disk ÷ cold: the issue's goal
is <= 0.2), and every round's figures.

`miss`: rounds alternate a server with the tier (writing every block of every prompt) and one
started with --no-kv-disk; each sends --prompts fresh prompts at once and times them to their
last token (--max-tokens each). Output tokens per second of each, and their ratio (the issue's
goal: the tier costs <= 3 %).

Run on a quiet machine where you can; on a shared one, take the ranges, and give the load
(`uptime` is printed first).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.client.servers import engine_server, served_model
from engine.kv.cache.prefix_cache import BlockHashChain
from engine.kv.disk.block_file import file_name

BLOCK_SIZE = 16  # the engine's default block size: the files of a prompt are found by its keys
TOKEN_RANGE = (256, 8000)  # ids every tokenizer of interest has, none of them special
REQUEST_TIMEOUT_S = 1800.0


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(length)]


def request_seconds(url: str, model: str, tokens: list[int], max_tokens: int = 1) -> float:
    body = {
        "model": model,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    start = time.perf_counter()
    reply = httpx.post(url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    elapsed = time.perf_counter() - start
    reply.raise_for_status()
    return elapsed


def metric(url: str, name: str) -> float:
    """The sum of a /metrics family's samples (every model's)."""
    text = httpx.get(url + "/metrics", timeout=30.0).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def wait_written(url: str, timeout: float = 600.0) -> None:
    """Until the server has no block left to write (the next server reads them)."""
    deadline = time.monotonic() + timeout
    time.sleep(0.5)  # the scheduler's report follows the last token
    while metric(url, "engine:kv_disk_unwritten_blocks") > 0:
        if time.monotonic() > deadline:
            raise TimeoutError("the server did not write its blocks in time")
        time.sleep(0.2)


def drop_page_cache(tier: Path, tokens: list[int]) -> int:
    """Drop the prompt's block files from the page cache (flushed first); how many there were."""
    chain = BlockHashChain(BLOCK_SIZE)
    names = {file_name(chain.key(tokens, i)) for i in range(len(tokens) // BLOCK_SIZE)}
    count = 0
    for path in tier.glob("*/*.kv"):
        if path.name not in names:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            count += 1
        finally:
            os.close(fd)
    return count


@contextlib.contextmanager
def server(args: argparse.Namespace, logs: Path, extra: list[str]) -> Iterator[tuple[str, str]]:
    engine_args = shlex.split(args.engine_args) + extra
    with engine_server(args.model, logs, engine_args, args.start_timeout) as url:
        model = served_model(url)
        request_seconds(url, model, prompt(random.Random(-1), 64))  # warm-up
        yield url, model


KINDS = ("disk, page cache dropped", "cold", "disk, page cache warm", "RAM")


def one_length(
    url: str,
    model: str,
    tier: Path,
    order: int,
    fresh: list[int],
    before: tuple[list[int], list[int]] | None,
) -> dict[str, float]:
    """One round's figures for one length: `fresh` cold then from RAM; `before` (the previous
    round's two prompts) from disk, the first with its files dropped from the page cache; the
    first two measures in `order` (0 or 1)."""
    seconds: dict[str, float] = {}
    measures: list[tuple[str, list[int]]] = [("cold", fresh)]
    if before is not None:
        if not drop_page_cache(tier, before[0]):
            raise RuntimeError("no block file of the previous round's prompt is on disk")
        measures.insert(order, (KINDS[0], before[0]))
        measures.append((KINDS[2], before[1]))
    measures.append(("RAM", fresh))
    for kind, tokens in measures:
        seconds[kind] = request_seconds(url, model, tokens)
    return seconds


def ttft(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    figures: dict[int, dict[str, list[float]]] = {n: {k: [] for k in KINDS} for n in args.tokens}
    with tempfile.TemporaryDirectory(prefix="kv-disk-bench-") as work:
        tier, logs = Path(work) / "tier", Path(work)
        extra = ["--kv-disk-path", str(tier), "--max-model-len", str(max(args.tokens) + 64)]
        previous: dict[int, tuple[list[int], list[int]]] = {}
        for round_index in range(args.rounds + 1):
            with server(args, logs, extra) as (url, model):
                for length in args.tokens:
                    fresh, other = prompt(rng, length), prompt(rng, length)
                    before = previous.get(length)
                    seconds = one_length(url, model, tier, round_index % 2, fresh, before)
                    for kind, value in seconds.items():
                        figures[length][kind].append(value)
                    request_seconds(url, model, other)  # the next round's warm-cache prompt
                    previous[length] = (fresh, other)
                wait_written(url)
            print(f"round {round_index} done", flush=True)
    for length in args.tokens:
        seen = figures[length]
        cold = statistics.median(seen["cold"])
        row = [f"{length:6d} tokens:"]
        for kind in KINDS:
            median = statistics.median(seen[kind])
            row.append(f"{kind} {median * 1000:.0f} ms ({median / cold:.3f}x)")
        print("  ".join(row))
        for kind in KINDS:
            print(f"    {kind}: " + " ".join(f"{s * 1000:.0f}" for s in seen[kind]) + " ms")


def miss(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    rates: dict[str, list[float]] = {"tier": [], "no tier": []}
    with tempfile.TemporaryDirectory(prefix="kv-disk-bench-") as work:
        tier, logs = Path(work) / "tier", Path(work)
        for round_index in range(2 * args.rounds):
            kind = ("tier", "no tier")[(round_index + round_index // 2) % 2]
            extra = ["--kv-disk-path", str(tier)] if kind == "tier" else ["--no-kv-disk"]
            with server(args, logs, extra) as (url, model):
                prompts = [prompt(rng, args.tokens[0]) for _ in range(args.prompts)]
                start = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                    list(
                        pool.map(lambda p: request_seconds(url, model, p, args.max_tokens), prompts)
                    )
                elapsed = time.perf_counter() - start
            rates[kind].append(args.prompts * args.max_tokens / elapsed)
            print(f"round {round_index}: {kind} {rates[kind][-1]:.1f} tokens/s", flush=True)
    ours, theirs = statistics.median(rates["tier"]), statistics.median(rates["no tier"])
    print(
        f"{args.prompts} prompts of {args.tokens[0]} tokens, {args.max_tokens} out each: "
        f"with the tier {ours:.1f} tokens/s, without {theirs:.1f} (median of {args.rounds}); "
        f"ratio {ours / theirs:.3f} (range {min(rates['tier']) / max(rates['no tier']):.3f}-"
        f"{max(rates['tier']) / min(rates['no tier']):.3f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("ttft", "miss"))
    parser.add_argument("--model", default=None, help="default: the engine's default model")
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8, help="miss: prompts sent at once")
    parser.add_argument("--max-tokens", type=int, default=32, help="miss: tokens out of each")
    parser.add_argument("--engine-args", default="", help="more flags for the server")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.tokens is None:
        args.tokens = [2000, 4000, 8000] if args.what == "ttft" else [1000]
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
    (ttft if args.what == "ttft" else miss)(args)


if __name__ == "__main__":
    main()
