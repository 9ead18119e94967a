"""Structured outputs' cost: throughput of N sequences where half carry a JSON schema against
the same N unconstrained, in one run; and the grammar compile time per schema.

    python tools/bench_structured.py                       # the demo model, 32 sequences
    python tools/bench_structured.py --model DIR --num-requests 32 --output-len 64

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


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
    parser.add_argument("--model", default=None, help="checkpoint (default: the demo model)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--schemas", type=int, default=20, help="distinct schemas compiled")
    parser.add_argument("--kv-cache-memory", type=int, default=256 * 2**20, help="bytes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from engine import LLM, SamplingParams
    from engine.messages.params import StructuredOutputsParams
    from engine.model.config import load_model_config
    from engine.model.default_model import ensure_default_model

    path = args.model or ensure_default_model()
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
        llm.generate(prompts[:2], [free, constrained(0)])  # warm-up (and the first compiles)
        figures = {}
        outputs = {}
        for name, params in (("unconstrained", [free] * len(prompts)), ("half JSON", mixed_params)):
            start = time.perf_counter()
            results = llm.generate(prompts, params)
            seconds = time.perf_counter() - start
            tokens = [r.outputs[0].token_ids for r in results]
            figures[name] = sum(map(len, tokens)) / seconds
            outputs[name] = tokens
    for name, rate in figures.items():
        print(f"{name:>14}: {rate:8.1f} output tokens/s ({args.num_requests} sequences)")
    cost = 1 - figures["half JSON"] / figures["unconstrained"]
    print(f"{'cost':>14}: {cost * 100:8.1f} % throughput")
    same = all(
        outputs["half JSON"][i] == outputs["unconstrained"][i]
        for i in range(0, args.num_requests, 2)
    )
    print(f"unconstrained half unchanged in the mixed batch: {same}")
    print(f"{'compile':>14}: {compile_times(path, vocab, args.schemas)}")


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
