"""Bytes per request on each ring: what one request costs the engine's messages.

    python tools/bench/ring_bytes.py                      # demo model, 1,000-token prompts
    python tools/bench/ring_bytes.py --prompt-tokens 4000 --requests 8 --dp 2

Runs requests through AsyncLLM one at a time, first with prompts given as token ids, then as
text (tokenized by the tokenizer actor), and reads the runtime's own count of what each actor
wrote to each ring (EngineStats.ring_traffic) before and after each kind. Prints, per ring, the
bytes written per request. The root's own ring to the tokenizer (`requests`) is not in that
count: its GenerateRequest is encoded here as the gateway sends it. The scheduler's periodic
report is left out of the total (it is sent on a timer, not per request). Each prompt is new
(no prefix-cache hit shortens a plan).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine import AsyncLLM, SamplingParams
from engine.launch.model_source import hf_checkpoint
from engine.library.llm import build_settings
from engine.messages.requests import EngineRequest, GenerateRequest
from engine.messages.ring_catalogue import REQUESTS_RING
from engine.model.config import load_model_config
from engine.settings.home import default_engine_home

PERIODIC_RINGS = ("reports",)  # on a timer: not a per-request cost
WORDS = ["the", "of", "and", "a", "to", "in", "is", "was", "he", "for", "it", "with"]


def _traffic(engine: AsyncLLM) -> dict[str, int]:
    """Bytes written so far, by ring (summed over the actors that write it)."""
    totals: dict[str, int] = {}
    for row in engine.stats().ring_traffic:
        ring = row.ring.split(".")[-1]
        totals[ring] = totals.get(ring, 0) + row.bytes
    return totals


async def _settled_traffic(engine: AsyncLLM) -> dict[str, int]:
    """The counts once every actor has reported all it wrote: each reports them with its
    heartbeat (runtime.heartbeat_interval), so they are read until two heartbeats add nothing."""
    interval = engine.settings.runtime.heartbeat_interval
    last = _traffic(engine)
    for _ in range(20):
        await asyncio.sleep(2 * interval)
        now = _traffic(engine)
        if now == last:
            return now
        last = now
    raise RuntimeError("the ring counts kept changing: is something else using the engine?")


async def _per_request(
    engine: AsyncLLM, prompts: list[list[int]] | list[str], params: SamplingParams
) -> tuple[dict[str, float], int]:
    """Bytes per request by ring for these prompts, and the mean prompt length in tokens."""
    before = await _settled_traffic(engine)
    prompt_tokens = 0
    for prompt in prompts:
        output = await engine.complete(prompt, params)
        prompt_tokens += len(output.prompt_token_ids)
    after = await _settled_traffic(engine)
    count = len(prompts)
    per_ring = {ring: (after[ring] - before.get(ring, 0)) / count for ring in sorted(after)}
    per_ring["requests"] = sum(map(_request_bytes, prompts)) / count
    return per_ring, prompt_tokens // count


def _request_bytes(prompt: list[int] | str) -> int:
    """The root's GenerateRequest for `prompt`, as the gateway sends it (a fresh request)."""
    text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    request = EngineRequest(
        request_id="req-0123abcd-0", params=params, prompt=text, prompt_token_ids=ids
    )
    return len(REQUESTS_RING.encode(GenerateRequest(request, 0, 2**62)))


def _text_prompt(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


async def measure(args: argparse.Namespace) -> dict[str, object]:
    settings = build_settings(**{"model.path": args.model, "parallel.data_parallel_size": args.dp})
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(args.seed)
    vocab = load_model_config(hf_checkpoint(args.model, default_engine_home())).vocab_size
    report: dict[str, object] = {}
    async with AsyncLLM(settings) as engine:
        await engine.complete([11, 12, 13], params)  # warm-up
        id_prompts = [
            [rng.randrange(10, vocab) for _ in range(args.prompt_tokens)]
            for _ in range(args.requests)
        ]
        text_prompts = [_text_prompt(rng, args.prompt_tokens) for _ in range(args.requests)]
        for kind, prompts in (("token_ids", id_prompts), ("text", text_prompts)):
            per_ring, prompt_tokens = await _per_request(engine, prompts, params)
            total = sum(v for ring, v in per_ring.items() if ring not in PERIODIC_RINGS)
            report[kind] = {
                "prompt_tokens": prompt_tokens,
                "bytes_per_request": {ring: round(v) for ring, v in per_ring.items()},
                "total_without_reports": round(total),
            }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args)), indent=2))


if __name__ == "__main__":
    main()
