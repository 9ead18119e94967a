"""How long a hung actor stalls the streams: each actor kind SIGSTOPped in turn under load, with a
long prompt's prefill chunks running beside, every stream compared with an undisturbed run.

    python tools/chaos/hang_stall.py                       # the default model, --deterministic
    python tools/chaos/hang_stall.py --model /tmp/llama-1b --engine-args "--quantization q4_1"

For each victim (worker0, scheduler, detokenizer, tokenizer, or --actors): `--streams` greedy
streams of `--tokens` tokens (EOS ignored) run while a client sends prompts of `--long-words`
words one after another (their prefill chunks take seconds on a large model); once every stream
has its first tokens, the victim is SIGSTOPped and left stopped. Printed per victim:

- found: seconds from the SIGSTOP until the victim's process was gone (the supervisor killed it);
- stall: the longest gap between two tokens of any stream across the fault, against the longest
  gap the undisturbed run had (its steps, including those beside a long prefill);
- the restart reason the supervisor gave, whether every stream equals its undisturbed twin, and
  whether anything else restarted (a long step taken for a hang would show there).

It serves with --deterministic (unless --no-deterministic) so that equality does not depend on
batching.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):  # run as a script: make `engine` and `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import itertools

from engine.cli.admin_client import send_command
from engine.client.servers import engine_running

VICTIMS = ("worker0", "scheduler", "detokenizer", "tokenizer")
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "tired",
    "cats",
    "watch",
]


async def stream(client: httpx.AsyncClient, model: str, index: int, tokens: int) -> list[Any]:
    """(text pieces, arrival times) of one greedy stream."""
    body = {
        "model": model,
        "prompt": f"Story {index}: " + " ".join(WORDS[(index + i) % len(WORDS)] for i in range(12)),
        "max_tokens": tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    pieces, times = [], []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
                times.append(time.monotonic())
    return [pieces, times]


async def long_prompts(
    client: httpx.AsyncClient, model: str, words: int, stop: asyncio.Event
) -> int:
    """Prompts of `words` words, one after another until `stop`: prefill running beside."""
    sent = 0
    while not stop.is_set():
        prompt = " ".join(WORDS[(sent + i) % len(WORDS)] for i in range(words))
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
        await client.post("/v1/completions", json=body)
        sent += 1
    return sent


def actors(socket: Path) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in send_command(socket, "actors", [], timeout=10.0)["result"]}


async def one_run(
    args: argparse.Namespace, url: str, socket: Path, victim: str | None
) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        stop = asyncio.Event()
        beside = asyncio.create_task(long_prompts(client, model, args.long_words, stop))
        await asyncio.sleep(args.lead_in)  # the long prompts' chunks are running
        before = actors(socket)
        streams = [
            asyncio.create_task(stream(client, model, i, args.tokens)) for i in range(args.streams)
        ]
        found = None
        if victim is not None:
            await asyncio.sleep(args.stop_after)
            pid = before[victim]["pid"]
            stopped_at = time.monotonic()
            os.kill(pid, signal.SIGSTOP)
            while Path(f"/proc/{pid}").exists() and time.monotonic() - stopped_at < 120:
                await asyncio.sleep(0.01)
            found = time.monotonic() - stopped_at
        results = await asyncio.gather(*streams)
        stop.set()
        await beside
        after = actors(socket)
    restarts = {n: after[n]["restarts"] - before[n]["restarts"] for n in before if n in after}
    gaps = [b - a for _, times in results for a, b in itertools.pairwise(times)]
    return {
        "texts": ["".join(pieces) for pieces, _ in results],
        "stall_s": max(gaps, default=0.0),
        "found_s": found,
        "restarts": {n: r for n, r in restarts.items() if r},
        "reason": after.get(victim or "", {}).get("last_restart_reason", ""),
    }


async def main_async(args: argparse.Namespace) -> int:
    logs = Path(args.logs or tempfile.mkdtemp(prefix="hang-stall-"))
    model_args = ["--model", args.model] if args.model else []
    command = ["serve", *model_args, "--host", "127.0.0.1", "--port", "0"]
    command += [] if args.no_deterministic else ["--deterministic"]
    command += ["--runtime.restart_intensity", "100", *shlex.split(args.engine_args)]
    with engine_running(command, logs / "engine.log", timeout=args.start_timeout) as server:
        assert server.admin_socket is not None
        reference = await one_run(args, server.url, server.admin_socket, None)
        print(
            f"undisturbed: longest gap between two tokens {reference['stall_s']:.2f} s", flush=True
        )
        ok = True
        for victim in args.actors.split(","):
            run = await one_run(args, server.url, server.admin_socket, victim)
            same = run["texts"] == reference["texts"]
            others = {n: r for n, r in run["restarts"].items() if n != victim}
            ok &= same and not others and run["restarts"].get(victim) == 1
            print(
                f"{victim}: found {run['found_s']:.2f} s after SIGSTOP, streams stalled "
                f"{run['stall_s']:.2f} s, identical {same}, other restarts {others or 'none'}; "
                f"reason: {run['reason']}",
                flush=True,
            )
    print(f"server log: {logs / 'engine.log'}")
    return 0 if ok else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="the model (default: the engine's default)")
    p.add_argument("--engine-args", default="", help="more flags for the server")
    p.add_argument("--actors", default=",".join(VICTIMS), help="comma-separated victims")
    p.add_argument(
        "--no-deterministic",
        action="store_true",
        help="serve without --deterministic (streams may then differ from the undisturbed run "
        "by batching alone)",
    )
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    p.add_argument("--long-words", type=int, default=1500, help="words of each long prompt")
    p.add_argument("--lead-in", type=float, default=2.0, help="seconds of long prompts first")
    p.add_argument("--stop-after", type=float, default=3.0, help="seconds of streams first")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--logs", help="where the server's log goes (default: a temp dir)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
