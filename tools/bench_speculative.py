"""Speculative decoding's speedup: one stream, n-gram proposals against none, on the same model.

Two engines run side by side (an idle one costs no CPU), one with --speculative-config and one
without; each round sends every prompt to each engine in turn, alternating which goes first, so
both see the same machine load. A prompt's decode rate is (output tokens - 1) over the time from
its first token to its last. Prompts: where lookup helps (repeating or editing a given text,
refactoring code) and where it does not (free writing). Greedy, so both engines produce the same
tokens (checked). The speculating engine's acceptance figures come from its stats.

    python tools/bench_speculative.py                      # the default model (SmolLM2-135M)
    python tools/bench_speculative.py --rounds 5 --max-tokens 200
    python tools/bench_speculative.py --llama-server       # also llama-server's ngram-simple

With --llama-server, llama.cpp's server (tools/llamacpp_peer.py) serves the same GGUF file with
and without `--spec-type ngram-simple` over the same chat prompts, one request at a time, and its
own timings (predicted_per_second) are printed beside ours.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `engine` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.api.async_llm import AsyncLLM
from engine.api.llm import engine_settings
from engine.hf_cache import with_resolved_model
from engine.messages.params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}  # fmt: skip

PARAGRAPH = (
    "The river begins high in the mountains, where snow melts each spring and feeds a hundred "
    "small streams. They join in the valley below, pass the old mill and the stone bridge, and "
    "turn slowly toward the sea. Farmers along its banks have watched it flood and fall for "
    "centuries, planting their fields by its rhythm and telling their children to respect it."
)
CODE = """def total_price(items):
    result = 0
    for item in items:
        if item.quantity > 0:
            result = result + item.price * item.quantity
    return result


def average_price(items):
    result = 0
    count = 0
    for item in items:
        if item.quantity > 0:
            result = result + item.price
            count = count + 1
    return result / count
"""
PROMPTS = {
    "repeat": (True, f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}"),
    "refactor": (
        True,
        f"Rename the variable `result` to `total` in this code and show the whole code:\n\n{CODE}",
    ),
    "story": (False, "Write a short story about a dragon who learns to paint."),
}


async def one_stream(engine: AsyncLLM, text: str, max_tokens: int) -> tuple[list[int], float]:
    """Output tokens and the decode rate (tokens after the first per second)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokens: list[int] = []
    first = last = 0.0
    async for output in engine.stream(messages=[{"role": "user", "content": text}], params=params):
        now = time.perf_counter()
        new = output.outputs[0].token_ids if output.outputs else []
        if new and not tokens:
            first = now
        tokens += new
        last = now
    rate = (len(tokens) - 1) / (last - first) if len(tokens) > 1 and last > first else 0.0
    return tokens, rate


async def bench_ours(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    engines: dict[str, AsyncLLM] = {}
    for name, config in (("plain", ""), ("ngram", json.dumps(NGRAM))):
        settings = engine_settings(
            None, {"model": args.model, "scheduler__speculative_config": config}
        )
        engines[name] = AsyncLLM(with_resolved_model(settings))
        await engines[name].start()
    chosen = {name: PROMPTS[name] for name in args.prompts}
    rates: dict[str, dict[str, list[float]]] = {p: {"plain": [], "ngram": []} for p in chosen}
    drafts = {p: {"drafts": 0, "proposed": 0, "accepted": 0} for p in chosen}
    steps = {p: {"plain": 0, "ngram": 0} for p in chosen}
    tokens = {p: {"plain": 0, "ngram": 0} for p in chosen}
    try:
        for round_index in range(args.rounds + 1):  # round 0 warms up, not counted
            order = ["plain", "ngram"] if round_index % 2 == 0 else ["ngram", "plain"]
            for prompt, (_, text) in chosen.items():
                outputs = {}
                for name in order:
                    before = await _counts(engines[name])
                    outputs[name], rate = await one_stream(engines[name], text, args.max_tokens)
                    if round_index:
                        rates[prompt][name].append(rate)
                        after = await _counts(engines[name])
                        steps[prompt][name] += after["steps"] - before["steps"]
                        tokens[prompt][name] += len(outputs[name])
                        if name == "ngram":
                            for key in drafts[prompt]:
                                drafts[prompt][key] += after[key] - before[key]
                if outputs["plain"] != outputs["ngram"]:
                    print(f"NOTE {prompt}: outputs differ (near-tie logits?)", file=sys.stderr)
        for prompt, counts in drafts.items():
            rate = counts["accepted"] / (counts["proposed"] or 1)
            per_step = {n: tokens[prompt][n] / (steps[prompt][n] or 1) for n in ("plain", "ngram")}
            print(f"{prompt}: {counts['drafts']} drafts, {counts['proposed']} proposed, "
                  f"{counts['accepted']} accepted ({rate:.0%}); tokens per step "
                  f"{per_step['plain']:.2f} plain, {per_step['ngram']:.2f} ngram")  # fmt: skip
        stats = engines["ngram"].stats()
        print(
            f"ngram engine: drafts {stats.spec_decode_num_drafts}, draft tokens "
            f"{stats.spec_decode_num_draft_tokens}, accepted "
            f"{stats.spec_decode_num_accepted_tokens} "
            f"(by position {stats.spec_decode_num_accepted_tokens_per_pos})"
        )
    finally:
        for engine in engines.values():
            await engine.shutdown()
    return rates


async def _counts(engine: AsyncLLM) -> dict[str, int]:
    """The engine's steps and spec_decode counts, once its scheduler has reported (0.2 s)."""
    await asyncio.sleep(0.5)
    stats = engine.stats()
    return {
        "steps": stats.num_steps,
        "drafts": stats.spec_decode_num_drafts,
        "proposed": stats.spec_decode_num_draft_tokens,
        "accepted": stats.spec_decode_num_accepted_tokens,
    }


def report(rates: dict[str, dict[str, list[float]]]) -> None:
    print(f"{'prompt':10} {'lookup helps':>12} {'plain tok/s':>12} {'ngram tok/s':>12} "
          f"{'ratio':>7}  per-round ratios")  # fmt: skip
    for prompt, by_engine in rates.items():
        plain, ngram = by_engine["plain"], by_engine["ngram"]
        ratios = [n / p for n, p in zip(ngram, plain, strict=True) if p]
        print(
            f"{prompt:10} {PROMPTS[prompt][0]!s:>12} {statistics.median(plain):12.1f} "
            f"{statistics.median(ngram):12.1f} {statistics.median(ratios):7.2f}  "
            + " ".join(f"{r:.2f}" for r in ratios)
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--model", default=None, help="checkpoint or GGUF (default model: unset)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--llama-server", action="store_true")
    parser.add_argument("--prompts", nargs="+", choices=list(PROMPTS), default=list(PROMPTS))
    args = parser.parse_args()
    report(asyncio.run(bench_ours(args)))
    if args.llama_server:
        from tools.bench_speculative_llamacpp import bench_llama_server

        chosen = {name: PROMPTS[name] for name in args.prompts}
        bench_llama_server(args, chosen, _llama_gguf(args.model))


def _llama_gguf(model: str | None) -> str:
    if model is not None:
        return model
    from engine.model_source import default_model_file

    return str(default_model_file())


if __name__ == "__main__":
    main()
