"""Speculative decoding's speedup: one stream, n-gram or draft-model proposals against none, on
the same model.

Engines run side by side (an idle one costs no CPU), one without --speculative-config and one
per method measured; each round sends every prompt to each engine in turn, the order rotating
from round to round, so all see the same machine load. A prompt's decode rate is (output tokens
- 1) over the time from its first token to its last. Prompts: where lookup helps (repeating a
given text, correcting its spelling, refactoring code) and where it does not (free writing).
Greedy, or with --temperature sampled with one seed (--seed): either way all engines produce the
same tokens (checked), except a draft engine verifying by vLLM's rejection sampler when sampling
(another draw of the same distribution). The speculating engines' acceptance figures come from
their stats.

    python tools/bench/speculative.py                      # the default model (SmolLM2-135M)
    python tools/bench/speculative.py --rounds 5 --max-tokens 200
    python tools/bench/speculative.py --draft random       # and a draft model
    python tools/bench/speculative.py --llama-server       # also llama-server's ngram-simple
    python tools/bench/speculative.py --ngram-tokens 4 8   # n-gram engines of 4 and 8 tokens
    python tools/bench/speculative.py --draft same --methods draft --temperature 0.8 \
        --acceptance-methods target_draw rejection_sampler  # both rules, sampled

--draft names the draft model: a checkpoint or GGUF sharing the model's tokenizer; `same` (the
model drafts for itself: every proposal accepted, at the cost of a second full model), or
`random` (a 2-layer random model with the model's vocabulary and tokenizer, built once under
$ENGINE_HOME/bench/: nothing accepted, so it measures what drafting costs). --methods ngram
leaves the draft engine out, --methods draft the n-gram one. --acceptance-methods runs a draft
engine per rule: `target_draw` (the default: "draft") and `rejection_sampler` ("draft-rs").

With --llama-server, llama.cpp's server (tools/peers/llamacpp_peer.py) serves the same GGUF file
with and without `--spec-type ngram-simple` over the same chat prompts, one request at a time, and
its own timings (predicted_per_second) are printed beside ours.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `engine` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.launch.hf_cache import with_resolved_model
from engine.library.async_llm import AsyncLLM
from engine.library.llm import engine_settings
from engine.messages.params import SamplingParams
from engine.scheduler.speculation import ACCEPTANCE_METHODS

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}
DRAFT_TOKENS = 4  # num_speculative_tokens with a draft model
REJECTION = "draft-rs"  # the draft engine verifying by vLLM's rejection sampler

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
# The paragraph with four words misspelt: editing a given text, as the issue names it.
TYPOS = (
    PARAGRAPH.replace("mountains", "mountians")
    .replace("streams", "steams")
    .replace("centuries", "centurys")
    .replace("respect", "respekt")
)
PROMPTS = {
    "repeat": (True, f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}"),
    "edit": (
        True,
        f"Correct the spelling mistakes in this text and write out the corrected text:\n\n{TYPOS}",
    ),
    "refactor": (
        True,
        f"Rename the variable `result` to `total` in this code and show the whole code:\n\n{CODE}",
    ),
    "story": (False, "Write a short story about a dragon who learns to paint."),
}


async def one_stream(
    engine: AsyncLLM, text: str, params: SamplingParams
) -> tuple[list[int], float]:
    """Output tokens and the decode rate (tokens after the first per second)."""
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
    for name, config in _engine_configs(args).items():
        settings = engine_settings(
            None, {"model": args.model, "scheduler__speculative_config": config}
        )
        engines[name] = AsyncLLM(with_resolved_model(settings))
        await engines[name].start()
    names = list(engines)
    chosen = {name: PROMPTS[name] for name in args.prompts}
    rates: dict[str, dict[str, list[float]]] = {p: {n: [] for n in names} for p in chosen}
    counted = {p: {n: dict.fromkeys(COUNTS, 0) for n in names} for p in chosen}
    params = SamplingParams(
        temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens
    )
    try:
        for round_index in range(args.rounds + 1):  # round 0 warms up, not counted
            shift = round_index % len(names)
            order = names[shift:] + names[:shift]
            for prompt, (_, text) in chosen.items():
                outputs = {}
                for name in order:
                    before = await _counts(engines[name])
                    outputs[name], rate = await one_stream(engines[name], text, params)
                    if round_index:
                        rates[prompt][name].append(rate)
                        after = await _counts(engines[name])
                        for key, count in after.items():
                            counted[prompt][name][key] += count - before[key]
                        counted[prompt][name]["tokens"] += len(outputs[name])
                for name in names[1:]:
                    if outputs[name] != outputs["plain"]:
                        why = "another draw" if name == REJECTION else "near-tie logits?"
                        print(
                            f"NOTE {prompt}: {name}'s output differs from plain's ({why})",
                            file=sys.stderr,
                        )
        print_acceptance(counted)
    finally:
        for engine in engines.values():
            await engine.shutdown()
    return rates


COUNTS = ("steps", "drafts", "proposed", "accepted", "tokens")


def print_acceptance(counted: dict[str, dict[str, dict[str, int]]]) -> None:
    for prompt, by_engine in counted.items():
        plain = by_engine["plain"]["tokens"] / (by_engine["plain"]["steps"] or 1)
        for name, counts in by_engine.items():
            if name == "plain":
                continue
            rate = counts["accepted"] / (counts["proposed"] or 1)
            per_step = counts["tokens"] / (counts["steps"] or 1)
            print(
                f"{prompt} {name}: {counts['drafts']} drafts, {counts['proposed']} proposed, "
                f"{counts['accepted']} accepted ({rate:.0%}); tokens per step "
                f"{plain:.2f} plain, {per_step:.2f} {name}"
            )


def _engine_configs(args: argparse.Namespace) -> dict[str, str]:
    """--speculative-config of each engine, by name ("plain": none)."""
    configs = {"plain": ""}
    if "ngram" in args.methods:
        for tokens in args.ngram_tokens:
            name = "ngram" if tokens == NGRAM["num_speculative_tokens"] else f"ngram-k{tokens}"
            configs[name] = json.dumps({**NGRAM, "num_speculative_tokens": tokens})
    if args.draft is not None and "draft" in args.methods:
        path = _draft_path(args)
        for method in args.acceptance_methods:
            name = REJECTION if method == "rejection_sampler" else "draft"
            draft = {
                "model": path,
                "num_speculative_tokens": DRAFT_TOKENS,
                "acceptance_method": method,
            }
            configs[name] = json.dumps(draft)
    return configs


def _draft_path(args: argparse.Namespace) -> str:
    """The draft: --draft's path; the model itself (`same`); or a random 2-layer model with the
    model's vocabulary and its tokenizer files (`random`), built once."""
    from engine.launch.model_source import model_directory
    from engine.settings import Settings, resolve_home

    if args.draft not in ("same", "random"):
        return str(args.draft)
    home = resolve_home(Settings())
    target, _ = model_directory(args.model, home)
    if args.draft == "same":
        return str(target)
    return _random_draft(Path(target), home / "bench")


def _random_draft(target: Path, root: Path) -> str:
    import shutil

    from engine.demo.checkpoint_maker import CheckpointSpec, make_checkpoint
    from engine.settings.home import build_directory

    vocab = int(json.loads((target / "config.json").read_text())["vocab_size"])
    spec = CheckpointSpec(arch="llama", vocab_size=vocab, tie_word_embeddings=True)
    out = root / f"random-draft-{target.name}"

    def build(staging: Path) -> None:
        make_checkpoint(staging, spec)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(target / name, staging / name)

    if not (out / "config.json").is_file():
        build_directory(out, build, "config.json")
    return str(out)


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
    print(
        f"{'prompt':10} {'method':8} {'lookup helps':>12} {'plain tok/s':>12} "
        f"{'spec tok/s':>11} {'ratio':>7} {'min-max':>11}  per-round ratios"
    )
    for prompt, by_engine in rates.items():
        plain = by_engine["plain"]
        for name, spec in by_engine.items():
            if name == "plain":
                continue
            ratios = [n / p for n, p in zip(spec, plain, strict=True) if p]
            print(
                f"{prompt:10} {name:8} {PROMPTS[prompt][0]!s:>12} "
                f"{statistics.median(plain):12.1f} {statistics.median(spec):11.1f} "
                f"{statistics.median(ratios):7.2f} {min(ratios):5.2f}-{max(ratios):<5.2f}  "
                + " ".join(f"{r:.2f}" for r in ratios)
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--model", default=None, help="checkpoint or GGUF (default model: unset)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--llama-server", action="store_true")
    parser.add_argument("--prompts", nargs="+", choices=list(PROMPTS), default=list(PROMPTS))
    parser.add_argument("--draft", default=None, help="draft model: a path, `same` or `random`")
    parser.add_argument(
        "--methods", nargs="+", choices=["ngram", "draft"], default=["ngram", "draft"]
    )
    parser.add_argument(
        "--acceptance-methods",
        nargs="+",
        choices=list(ACCEPTANCE_METHODS),
        default=["target_draw"],
        help="a draft engine per rule for sampled proposals",
    )
    parser.add_argument(
        "--ngram-tokens",
        type=int,
        nargs="+",
        default=[NGRAM["num_speculative_tokens"]],
        help="num_speculative_tokens of each n-gram engine (and llama-server's --spec-draft-n-max:"
        " the largest)",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--seed", type=int, default=0, help="every request's, when sampling")
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C, so that the engines and llama-servers started are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    report(asyncio.run(bench_ours(args)))
    if args.llama_server:
        from tools.peers.llamacpp_speculative import bench_llama_server

        chosen = {name: PROMPTS[name] for name in args.prompts}
        bench_llama_server(args, chosen, _llama_gguf(args.model))


def _llama_gguf(model: str | None) -> str:
    if model is not None:
        return model
    from engine.launch.model_source import default_model_file

    return str(default_model_file())


if __name__ == "__main__":
    main()
