"""Chaos: a streaming workload against a running server while random actors are SIGKILLed, then
the same workload undisturbed; every stream of the first run must equal its twin in the second.

    python -m engine --runtime.restart_intensity 100 --runtime.restart_period 10 &
    python tools/chaos.py --requests 200 --concurrency 16 --kills 24

The workload: N streaming completions, half greedy and half seeded sampling, EOS ignored (every
request runs to its own max_tokens), half with a stop string that never matches (so the
detokenizer holds text back all along). Victims are drawn from the running actors that
`python -m engine admin actors --json` lists, at random gaps, while the workload runs.

Printed: requests, completed, lost (no normal end: an error, a cut stream), mismatched (text or
token sequence differs from the undisturbed run), duplicated tokens (tokens beyond the
undisturbed count), kills and restarts by actor, and recovery time per kill: from the kill until
every stream then in flight has received its next token (p50 / p99 over kills, and by victim).

The server's restart intensity (runtime.restart_intensity restarts within
runtime.restart_period seconds, default 5 in 60 s) must allow the kill rate, as above; the
backoff between restarts grows with restarts inside the period, so a short period keeps the
restarts quick. Exit status 0 when nothing was lost, mismatched or duplicated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
    "tired", "sailors", "sing", "about", "rivers", "mountains", "lanterns", "copper", "bread",
    "winter", "gardens", "clocks", "and", "the", "patient", "moon",
)  # fmt: skip
NEVER = "<never seen>"  # a stop string no output contains


@dataclass(frozen=True)
class Job:
    prompt: str
    body: dict[str, Any]


@dataclass
class Stream:
    request_id: str = ""
    tokens: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # arrival of each token (monotonic)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    start: float = 0.0
    end: float = 0.0

    @property
    def completed(self) -> bool:
        return self.error is None and self.finish_reason is not None


@dataclass(frozen=True)
class Kill:
    at: float
    name: str
    pid: int


def make_workload(args: argparse.Namespace, model: str) -> list[Job]:
    rng = random.Random(args.seed)
    jobs = []
    for i in range(args.requests):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24)))
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            "max_tokens": rng.randint(args.min_tokens, args.max_tokens),
            "ignore_eos": True,
            "stream": True,
            "logprobs": 0,  # each event names its tokens, so tokens can be counted and compared
            "temperature": 0.0,
        }
        if i % 2:
            body.update(temperature=0.8, top_p=0.95, seed=args.seed * 100_003 + i)
        if i % 4 < 2:
            body["stop"] = [NEVER]
        jobs.append(Job(prompt, body))
    return jobs


async def stream_one(client: httpx.AsyncClient, job: Job, timeout: float) -> Stream:
    out = Stream(start=time.monotonic())
    try:
        async with client.stream("POST", "/v1/completions", json=job.body, timeout=timeout) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                out.error = f"HTTP {r.status_code}: {body[:200]}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                out.request_id = out.request_id or event.get("id", "")
                if "error" in event:
                    out.error = str(event["error"].get("message", event["error"]))
                    break
                now = time.monotonic()
                for choice in event.get("choices", []):
                    tokens = (choice.get("logprobs") or {}).get("tokens") or []
                    out.tokens += tokens
                    out.times += [now] * len(tokens)
                    out.text += choice.get("text", "")
                    out.finish_reason = choice.get("finish_reason") or out.finish_reason
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        out.end = time.monotonic()
    return out


async def run_workload(args: argparse.Namespace, jobs: list[Job]) -> list[Stream]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits) as client:
        gate = asyncio.Semaphore(args.concurrency)

        async def one(job: Job) -> Stream:
            async with gate:
                return await stream_one(client, job, args.request_timeout)

        return list(await asyncio.gather(*(one(job) for job in jobs)))


async def admin_actors(args: argparse.Namespace) -> list[dict[str, Any]]:
    """What `python -m engine admin actors --json` says (the pids to kill come from here)."""
    socket = ["--socket", args.socket] if args.socket else []
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "engine", "admin", *socket, "actors", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
    if proc.returncode != 0:
        raise RuntimeError(f"engine admin actors failed: {stderr.decode().strip()}")
    reply = json.loads(stdout)
    if not reply.get("ok"):
        raise RuntimeError(f"engine admin actors refused: {reply.get('error')}")
    rows: list[dict[str, Any]] = reply["result"]
    return rows


async def kill_randomly(
    args: argparse.Namespace, rng: random.Random, done: asyncio.Event
) -> list[Kill]:
    kills: list[Kill] = []
    targets = set(args.actors.split(",")) if args.actors else None
    while len(kills) < args.kills and not done.is_set():
        try:
            await asyncio.wait_for(done.wait(), rng.uniform(args.min_gap, args.max_gap))
            break  # the workload ended
        except TimeoutError:
            pass
        rows = await admin_actors(args)
        running = [
            row
            for row in rows
            if row["state"] == "running"
            and row["pid"]
            and (targets is None or row["name"] in targets)
        ]
        if not running:
            continue  # everything is restarting; try again after the next gap
        victim = rng.choice(running)
        try:
            os.kill(victim["pid"], signal.SIGKILL)
        except ProcessLookupError:
            continue
        kills.append(Kill(time.monotonic(), victim["name"], victim["pid"]))
        print(f"  kill {len(kills):3d}: {victim['name']} (pid {victim['pid']})", flush=True)
    return kills


async def chaos_phase(args: argparse.Namespace, jobs: list[Job]) -> tuple[list[Stream], list[Kill]]:
    done = asyncio.Event()
    killer = asyncio.ensure_future(kill_randomly(args, random.Random(args.seed + 1), done))
    try:
        streams = await run_workload(args, jobs)
    finally:
        done.set()
    return streams, await killer


def recovery_times(streams: list[Stream], kills: list[Kill]) -> list[tuple[str, float]]:
    """Per kill (victim, seconds): until every stream in flight at the kill (and not yet done)
    got a new token."""
    out = []
    for kill in kills:
        waits = []
        for stream in streams:
            if not stream.start <= kill.at < stream.end:
                continue
            following = [t for t in stream.times if t > kill.at]
            if following:
                waits.append(following[0] - kill.at)
        if waits:
            out.append((kill.name, max(waits)))
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def compare(chaos: list[Stream], reference: list[Stream]) -> dict[str, Any]:
    lost = [i for i, s in enumerate(chaos) if not s.completed]
    mismatched = [
        i
        for i, (s, r) in enumerate(zip(chaos, reference, strict=True))
        if s.completed and (s.tokens != r.tokens or s.text != r.text)
    ]
    duplicated = sum(
        max(0, len(s.tokens) - len(r.tokens))
        for s, r in zip(chaos, reference, strict=True)
        if s.completed
    )
    return {
        "requests": len(chaos),
        "completed": len(chaos) - len(lost),
        "lost": len(lost),
        "mismatched": len(mismatched),
        "duplicated_tokens": duplicated,
        "reference_failures": sum(1 for r in reference if not r.completed),
        "lost_examples": [(i, chaos[i].error) for i in lost[:5]],
        "mismatched_examples": [
            describe_mismatch(i, chaos[i], reference[i]) for i in mismatched[:5]
        ],
        "tokens": sum(len(s.tokens) for s in chaos),
    }


def describe_mismatch(index: int, chaos: Stream, reference: Stream) -> str:
    """Where request `index` first differs from its undisturbed twin, with its id to find it in
    the server log."""
    pairs = zip(chaos.tokens, reference.tokens, strict=False)
    at = next((k for k, (a, b) in enumerate(pairs) if a != b), None)
    if at is None:
        at = min(len(chaos.tokens), len(reference.tokens))
    return (
        f"request {index} ({chaos.request_id}): tokens differ from #{at} "
        f"({len(chaos.tokens)} vs {len(reference.tokens)} tokens): "
        f"{chaos.tokens[at : at + 3]!r} vs {reference.tokens[at : at + 3]!r}; "
        f"text equal: {chaos.text == reference.text}"
    )


def restarts_by_actor(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> Counter[str]:
    was = {row["name"]: row["restarts"] for row in before}
    return Counter({row["name"]: row["restarts"] - was.get(row["name"], 0) for row in after})


def longest_stall(streams: list[Stream]) -> float:
    gaps = [b - a for s in streams for a, b in zip([s.start, *s.times], s.times, strict=False)]
    return max(gaps, default=0.0)


async def main_async(args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=30) as client:
        models = (await client.get("/v1/models")).raise_for_status().json()
    model = models["data"][0]["id"]
    jobs = make_workload(args, model)
    print(f"chaos: {len(jobs)} requests, {args.concurrency} at a time, on {model} at {args.url}")
    before = await admin_actors(args)
    started = time.monotonic()
    chaos, kills = await chaos_phase(args, jobs)
    chaos_s = time.monotonic() - started
    await asyncio.sleep(args.settle)  # the last restart may still be under way
    after = await admin_actors(args)
    print("reference: the same workload, undisturbed", flush=True)
    started = time.monotonic()
    reference = await run_workload(args, jobs)
    reference_s = time.monotonic() - started

    summary = compare(chaos, reference)
    recovered = recovery_times(chaos, kills)
    recoveries = [seconds for _, seconds in recovered]
    by_victim: dict[str, list[float]] = {}
    for name, seconds in recovered:
        by_victim.setdefault(name, []).append(seconds)
    summary.update(
        recovery_p50_by_actor_s={name: percentile(v, 50) for name, v in sorted(by_victim.items())},
        recovery_p99_by_actor_s={name: percentile(v, 99) for name, v in sorted(by_victim.items())},
        kills=len(kills),
        kills_by_actor=dict(Counter(kill.name for kill in kills)),
        restarts_by_actor=dict(restarts_by_actor(before, after)),
        recovery_p50_s=percentile(recoveries, 50) if recoveries else None,
        recovery_p99_s=percentile(recoveries, 99) if recoveries else None,
        recovery_max_s=max(recoveries, default=None),
        longest_stall_s=longest_stall(chaos),
        chaos_phase_s=chaos_s,
        reference_phase_s=reference_s,
    )
    print_summary(summary)
    if args.json:
        print(json.dumps(summary))
    bad = summary["lost"] or summary["mismatched"] or summary["duplicated_tokens"]
    return 1 if bad or summary["reference_failures"] else 0


def print_summary(s: dict[str, Any]) -> None:
    def by_actor(counts: dict[str, int]) -> str:
        return ", ".join(f"{name} {n}" for name, n in sorted(counts.items()) if n) or "none"

    def seconds(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f} s"

    rows = [
        ("requests", s["requests"]),
        ("completed", s["completed"]),
        ("lost", s["lost"]),
        ("mismatched", s["mismatched"]),
        ("duplicated tokens", s["duplicated_tokens"]),
        ("tokens streamed", s["tokens"]),
        ("kills", f"{s['kills']} ({by_actor(s['kills_by_actor'])})"),
        ("restarts by actor", by_actor(s["restarts_by_actor"])),
        ("recovery p50 / p99", f"{seconds(s['recovery_p50_s'])} / {seconds(s['recovery_p99_s'])}"
         f" (max {seconds(s['recovery_max_s'])}; kill -> next token on every stream in flight)"),
        ("recovery by victim", ", ".join(
            f"{name} {p50:.3f} / {s['recovery_p99_by_actor_s'][name]:.3f} s"
            for name, p50 in s["recovery_p50_by_actor_s"].items()
        ) or "n/a"),
        ("longest stall", seconds(s["longest_stall_s"])),
        ("phases", f"chaos {s['chaos_phase_s']:.1f} s, reference {s['reference_phase_s']:.1f} s"),
    ]  # fmt: skip
    for name, value in rows:
        print(f"{name:20s} {value}")
    if s["lost_examples"]:
        print(f"lost, e.g.: {s['lost_examples']}")
    if s["mismatched_examples"]:
        for example in s["mismatched_examples"]:
            print(f"mismatched: {example}")
    if s["reference_failures"]:
        print(f"warning: {s['reference_failures']} request(s) failed in the undisturbed run too")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--api-key", default=os.environ.get("ENGINE_API_KEY"), help="if it wants one")
    p.add_argument("--socket", help="its admin socket (default: the newest live one)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16, help="streams in flight at once")
    p.add_argument("--min-tokens", type=int, default=64, help="max_tokens is drawn from here..")
    p.add_argument("--max-tokens", type=int, default=256, help="..to here")
    p.add_argument("--kills", type=int, default=20, help="at most this many kills")
    p.add_argument("--min-gap", type=float, default=0.5, help="seconds between kills, from..")
    p.add_argument("--max-gap", type=float, default=2.5, help="..to")
    p.add_argument("--actors", help="comma-separated actor names to kill (default: any)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--settle", type=float, default=3.0, help="wait after the chaos phase")
    p.add_argument("--json", action="store_true", help="also print the summary as JSON")
    args = p.parse_args(argv)
    if not 0 < args.min_tokens <= args.max_tokens:
        p.error(f"need 0 < --min-tokens <= --max-tokens, got {args.min_tokens}, {args.max_tokens}")
    if not 0 <= args.min_gap <= args.max_gap:
        p.error(f"need 0 <= --min-gap <= --max-gap, got {args.min_gap}, {args.max_gap}")
    if args.requests < 1 or args.concurrency < 1:
        p.error("--requests and --concurrency must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
