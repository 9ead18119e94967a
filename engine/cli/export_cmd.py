"""`engine export FILE.gguf DIR`: write a GGUF model as a Hugging Face checkpoint directory."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path


def run_export(argv: list[str], environ: Mapping[str, str]) -> int:
    parser = argparse.ArgumentParser(
        prog="engine export",
        description="write a GGUF file (or the default model) as a float32 Hugging Face "
        "checkpoint: config, generation config, tokenizer, chat template, model.safetensors",
    )
    parser.add_argument("gguf", help="a .gguf file, or 'default' for the default model's file")
    parser.add_argument("out", type=Path, help="a new directory")
    args = parser.parse_args(argv)
    from engine.gguf.export import export_checkpoint
    from engine.launch.model_source import default_model_file

    try:
        source = default_model_file() if args.gguf == "default" else Path(args.gguf)
        if not source.is_file():
            raise ValueError(f"{args.gguf}: no such file")
        export_checkpoint(source, args.out)
    except (ValueError, OSError) as e:
        print(f"engine export: {e}", file=sys.stderr)
        return 1
    print(f"exported {source.name} to {args.out}")
    return 0
