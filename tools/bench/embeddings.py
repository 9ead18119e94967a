"""Embeddings per second beside generation traffic, on one engine (the demo model by default).

Each round runs three phases on the same engine, in turn: embeddings alone, generation alone,
and both at once (the embeddings batched with the decoding streams). Embeddings: a closed loop
of `--embed-concurrency` clients, each sending prompts of `--embed-tokens` token ids, one after
another, for `--seconds`. Generation: `--streams` greedy streams of `--max-tokens` tokens, sent
again as each ends, for the same time. Printed per round: embeddings/s and output tokens/s alone
and together, and the ratios together / alone (same round, so the same machine load).

    python tools/bench/embeddings.py                          # demo model, 3 rounds
    python tools/bench/embeddings.py --model /path/to/ckpt --pooling mean --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `engine` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.launch.hf_cache import with_resolved_model
from engine.library.async_llm import AsyncLLM
from engine.library.embeddings import embed
from engine.library.llm import engine_settings
from engine.messages.params import PoolingParams, SamplingParams


async def embed_loop(engine: AsyncLLM, args: argparse.Namespace, until: float) -> int:
    rng = random.Random(0)
    pooling = PoolingParams(pooling_type=args.pooling.upper())
    done = 0

    async def client() -> None:
        nonlocal done
        while time.monotonic() < until:
            prompt = [rng.randrange(3, 1000) for _ in range(args.embed_tokens)]
            await embed(engine, prompt, pooling)
            done += 1

    await asyncio.gather(*(client() for _ in range(args.embed_concurrency)))
    return done


async def generate_loop(engine: AsyncLLM, args: argparse.Namespace, until: float) -> int:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    tokens = 0

    async def stream(seed: int) -> None:
        nonlocal tokens
        rng = random.Random(seed)
        while time.monotonic() < until:
            prompt = [rng.randrange(3, 1000) for _ in range(32)]
            async for delta in engine.stream(prompt, params):
                tokens += sum(len(output.token_ids) for output in delta.outputs)

    await asyncio.gather(*(stream(seed) for seed in range(args.streams)))
    return tokens


async def run_round(engine: AsyncLLM, args: argparse.Namespace) -> tuple[float, ...]:
    until = time.monotonic() + args.seconds
    alone_embeds = await embed_loop(engine, args, until) / args.seconds
    until = time.monotonic() + args.seconds
    alone_tokens = await generate_loop(engine, args, until) / args.seconds
    until = time.monotonic() + args.seconds
    both_embeds, both_tokens = await asyncio.gather(
        embed_loop(engine, args, until), generate_loop(engine, args, until)
    )
    return (alone_embeds, alone_tokens, both_embeds / args.seconds, both_tokens / args.seconds)


async def main(args: argparse.Namespace) -> None:
    settings = with_resolved_model(engine_settings(None, {"model": args.model}))
    engine = AsyncLLM(settings)
    await engine.start()
    try:
        await run_round(engine, argparse.Namespace(**{**vars(args), "seconds": 2.0}))  # warm up
        print(
            "round  embeds/s alone  tok/s alone  embeds/s both  tok/s both  embeds ratio  tok ratio"
        )
        for index in range(args.rounds):
            embeds, tokens, embeds_both, tokens_both = await run_round(engine, args)
            print(
                f"{index:5d}  {embeds:14.1f}  {tokens:11.1f}  {embeds_both:13.1f}  "
                f"{tokens_both:10.1f}  {embeds_both / embeds:12.2f}  {tokens_both / tokens:9.2f}"
            )
    finally:
        await engine.shutdown()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--pooling", choices=["last", "mean"], default="last")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="per phase")
    parser.add_argument("--embed-tokens", type=int, default=64)
    parser.add_argument("--embed-concurrency", type=int, default=8)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
