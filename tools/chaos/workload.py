"""The workload of tools/chaos/run.py: streamed completions whose every token is counted and
timed."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

WORDS = (
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
    "sailors",
    "sing",
    "about",
    "rivers",
    "mountains",
    "lanterns",
    "copper",
    "bread",
    "winter",
    "gardens",
    "clocks",
    "and",
    "the",
    "patient",
    "moon",
)
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
