"""Structured outputs' cost: throughput of N sequences where half carry a JSON schema against
the same N unconstrained, in one run; and the grammar compile time per schema.

    python tools/bench/structured.py                       # the default model, 32 sequences
    python tools/bench/structured.py --model DIR --num-requests 32 --output-len 64

Every request decodes exactly --output-len tokens (greedy): the schema (an array that needs
more items than fit) cannot close within them, and unconstrained requests ignore EOS, so both
batches do the same work and differ only by the grammar masks. Also reported: whether the
unconstrained half produced the same tokens in the mixed batch as alone.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def schema(variant: int) -> dict[str, Any]:
    """A schema no answer of --output-len tokens can complete (`variant` makes it distinct)."""
    return {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "words": {"type": "array", "items": {"type": "string"}, "minItems": 500 + variant},
        },
        "required": ["words", "id"],
        "additionalProperties": False,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=None,
        help="checkpoint, .gguf file or 'demo' (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--schemas", type=int, default=20, help="distinct schemas compiled")
    parser.add_argument("--kv-cache-memory", type=int, default=256 * 2**20, help="bytes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=5, help="each batch's runs (median)")
    args = parser.parse_args()

    from engine import LLM, SamplingParams
    from engine.launch.model_source import model_directory
    from engine.messages.params import StructuredOutputsParams
    from engine.model.config import load_model_config
    from engine.settings.home import default_engine_home

    path, _ = model_directory(args.model, default_engine_home())
    vocab = load_model_config(path, None).vocab_size
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(10, vocab) for _ in range(args.input_len)] for _ in range(args.num_requests)
    ]
    free = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    def constrained(i: int) -> SamplingParams:
        spec = StructuredOutputsParams(json=schema(i % 4))
        return SamplingParams(max_tokens=args.output_len, temperature=0.0, structured_outputs=spec)

    mixed_params = [constrained(i) if i % 2 else free for i in range(args.num_requests)]
    options = {
        "kv_cache_memory": args.kv_cache_memory,
        "scheduler__max_num_seqs": args.num_requests,
    }
    with LLM(path, **options) as llm:
        # Warm-up, and the schemas' first compiles (a worker compiles each schema once).
        llm.generate(prompts[:8], [constrained(i) for i in range(8)], use_tqdm=False)
        rates: dict[str, list[float]] = {"unconstrained": [], "half JSON": []}
        outputs = {}
        batches = (("unconstrained", [free] * len(prompts)), ("half JSON", mixed_params))
        for _ in range(args.rounds):  # alternated: a busy machine's drift hits both alike
            for name, params in batches:
                start = time.perf_counter()
                results = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                tokens = [r.outputs[0].token_ids for r in results]
                rates[name].append(sum(map(len, tokens)) / seconds)
                outputs[name] = tokens
    figures = {name: statistics.median(values) for name, values in rates.items()}
    for name, rate in figures.items():
        spread = ", ".join(f"{value:.0f}" for value in rates[name])
        print(f"{name:>14}: {rate:8.1f} output tokens/s, median of {args.rounds} ({spread})")
    cost = 1 - figures["half JSON"] / figures["unconstrained"]
    print(f"{'cost':>14}: {cost * 100:8.1f} % throughput")
    same = all(
        outputs["half JSON"][i] == outputs["unconstrained"][i]
        for i in range(0, args.num_requests, 2)
    )
    print(f"unconstrained half unchanged in the mixed batch: {same}")
    step_ms = args.num_requests / figures["unconstrained"] * 1e3
    free_ms, mixed_ms = sampler_times(path, vocab, args.num_requests)
    print(
        f"{'sampler step':>14}: {free_ms:.2f} ms unconstrained, {mixed_ms:.2f} ms half JSON "
        f"(+{mixed_ms - free_ms:.2f} ms against an engine step of {step_ms:.1f} ms: "
        f"{(mixed_ms - free_ms) / step_ms * 100:.1f} %)"
    )
    print(f"{'compile':>14}: {compile_times(path, vocab, args.schemas)}")


def sampler_times(path: str, vocab: int, count: int, steps: int = 64) -> tuple[float, float]:
    """Milliseconds per Sampler.sample call for `count` rows: none constrained, half constrained
    (the sampler's share of the cost, free of the machine's noise in whole-engine figures)."""
    import torch

    from engine.messages.params import SamplingParams, StructuredOutputsParams
    from engine.model.config import load_model_config
    from engine.model.sampling.sampler import Sampler
    from engine.model.step_inputs import SequenceStart
    from engine.structured.grammars import GrammarService

    eos = list(load_model_config(path, None).eos_token_ids)
    service = GrammarService(path, vocab, eos)
    generator = torch.Generator().manual_seed(0)
    logits = [torch.randn(count, vocab, generator=generator) for _ in range(steps)]
    timings = []
    for constrained in (False, True):
        sampler = Sampler(vocab, eos, service)
        params = []
        for i in range(count):
            spec = StructuredOutputsParams(json=schema(i % 4)) if constrained and i % 2 else None
            params.append(SamplingParams(temperature=0.0, ignore_eos=True, structured_outputs=spec))
            sampler.add(SequenceStart(i, [1, 2, 3], [], params[i], 0))
        sampler.sample(list(range(count)), logits[0])  # the grammars compiled, the first mask
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for step in logits[1:]:
                sampler.sample(list(range(count)), step)
            best = min(best, (time.perf_counter() - start) / (steps - 1) * 1e3)
            for i in range(count):  # the same steps again from the same start
                sampler.add(SequenceStart(i, [1, 2, 3], [], params[i], 0))
            sampler.sample(list(range(count)), logits[0])
        timings.append(best)
    service.close()
    return timings[0], timings[1]


def compile_times(path: str, vocab: int, count: int) -> str:
    """Milliseconds from a new schema to its first mask (llguidance builds lazily)."""
    from engine.messages.params import StructuredOutputsParams
    from engine.model.config import load_model_config
    from engine.structured.bitmask import fill_bitmask
    from engine.structured.grammars import GrammarService, SequenceMatcher

    eos = list(load_model_config(path, None).eos_token_ids)
    service = GrammarService(path, vocab, eos)
    service.hf_tokenizer()  # the tokenizer load is once per worker, not per schema
    times = []
    for variant in range(count):
        spec = StructuredOutputsParams(json=json.dumps(schema(1000 + variant)))
        start = time.perf_counter()
        matcher = SequenceMatcher(service.compile(spec)).ready([])
        fill_bitmask(service.executor, [matcher], vocab, eos)
        times.append((time.perf_counter() - start) * 1e3)
    service.close()
    return (
        f"median {statistics.median(times):.2f} ms, max {max(times):.2f} ms per schema "
        f"(to first mask, {count} schemas)"
    )


if __name__ == "__main__":
    main()
