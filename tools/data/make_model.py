"""Make a seeded random checkpoint (Llama, Qwen2 or Qwen3) in the Hugging Face layout, offline.

    python tools/data/make_model.py --out /tmp/tiny-llama --arch llama --layers 2 --hidden 64
    python tools/data/make_model.py --out /tmp/demo --preset demo          # the built-in demo model
    python tools/data/make_model.py --out /tmp/l3 --arch llama \\
        --rope-scaling '{"rope_type": "llama3", "factor": 8, "low_freq_factor": 1,
                         "high_freq_factor": 4, "original_max_position_embeddings": 8192}'

The output (config.json, safetensors, tokenizer with a ChatML template, generation_config.json)
loads in transformers, vLLM and this engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `engine` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.demo.checkpoint_maker import ARCH_CLASSES, DTYPES, CheckpointSpec, make_checkpoint

# flag -> CheckpointSpec field
FLAGS = {
    "arch": "arch",
    "layers": "num_layers",
    "hidden": "hidden_size",
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "intermediate": "intermediate_size",
    "vocab": "vocab_size",
    "rope_theta": "rope_theta",
    "max_position_embeddings": "max_position_embeddings",
    "dtype": "dtype",
    "init_std": "init_std",
    "seed": "seed",
    "max_shard_size": "max_shard_size",
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    defaults = CheckpointSpec()
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", required=True, help="directory to write (created if missing)")
    parser.add_argument(
        "--preset",
        choices=["tiny", "demo"],
        default="tiny",
        help="starting sizes: tiny (tests) or demo (the built-in demo model)",
    )
    parser.add_argument("--arch", choices=sorted(ARCH_CLASSES))
    parser.add_argument("--layers", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--head-dim", type=int, help="default hidden / heads")
    parser.add_argument("--intermediate", type=int)
    parser.add_argument("--vocab", type=int, help="vocabulary size (tokenizer and embeddings)")
    parser.add_argument(
        "--tie",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="tie the output projection to the embeddings",
    )
    parser.add_argument(
        "--attention-bias",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bias on q/k/v/o (llama, qwen3; qwen2 always has q/k/v bias)",
    )
    parser.add_argument("--rope-theta", type=float)
    parser.add_argument(
        "--rope-scaling",
        type=json.loads,
        help='JSON, e.g. \'{"rope_type": "linear", "factor": 2.0}\'',
    )
    parser.add_argument("--max-position-embeddings", type=int)
    parser.add_argument("--dtype", choices=DTYPES)
    parser.add_argument(
        "--init-std", type=float, help=f"weight init spread (default {defaults.init_std})"
    )
    parser.add_argument("--seed", type=int)
    parser.add_argument("--max-shard-size", help='save as shards of at most this, e.g. "2MB"')
    parser.add_argument("--corpus", type=Path, help="text file to train the tokenizer on")
    return parser.parse_args(argv)


def spec_from_args(args: argparse.Namespace) -> CheckpointSpec:
    if args.preset == "demo":
        from engine.demo.default_model import DEFAULT_MODEL_SPEC

        spec = DEFAULT_MODEL_SPEC
    else:
        spec = CheckpointSpec()
    changes: dict[str, Any] = {
        field: getattr(args, flag)
        for flag, field in FLAGS.items()
        if getattr(args, flag) is not None
    }
    if args.tie is not None:
        changes["tie_word_embeddings"] = args.tie
    if args.attention_bias is not None:
        changes["attention_bias"] = args.attention_bias
    if args.rope_scaling is not None:
        changes["rope_scaling"] = args.rope_scaling
    spec = dataclasses.replace(spec, **changes)
    spec.validate()
    return spec


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        spec = spec_from_args(args)
    except ValueError as error:
        raise SystemExit(f"make_model: {error}") from None
    corpus = args.corpus.read_text(encoding="utf-8") if args.corpus else None
    out = make_checkpoint(args.out, spec, corpus=corpus)
    print(out)


if __name__ == "__main__":
    main()
