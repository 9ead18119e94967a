"""`engine export FILE.gguf DIR`: a GGUF file as a float32 Hugging Face checkpoint (config,
generation config, tokenizer with its chat template, model.safetensors), for peers that cannot
read GGUF, vLLM on the CPU among them. The weights are the file's, dequantized, with llama's q/k
rows back in Hugging Face order: what the engine itself serves from the file."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from engine.gguf.hf_config import generation_config, hf_config
from engine.gguf.hf_tokenizer import write_tokenizer
from engine.gguf.metadata import GGUFError
from engine.gguf.reader import read_gguf
from engine.gguf.weights import GGUFTensors


def export_checkpoint(gguf_path: Path, out: Path) -> None:
    """Write the checkpoint into `out` (created; refused if it exists and is not empty)."""
    if out.exists() and any(out.iterdir()):
        raise GGUFError(f"{out} exists and is not empty: name a new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=out.parent))
    try:
        with read_gguf(gguf_path) as gguf:
            (staging / "config.json").write_text(json.dumps(hf_config(gguf), indent=2))
            (staging / "generation_config.json").write_text(
                json.dumps(generation_config(gguf), indent=2)
            )
            write_tokenizer(gguf, staging)
            tensors = GGUFTensors(gguf)
            weights = {
                name: np.ascontiguousarray(tensors.rows(name, 0, tensors.shape(name)[0]))
                for name in tensors.keys()  # noqa: SIM118 (not a dict)
            }
            save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
        staging.chmod(0o755)
        (staging / "model.safetensors").chmod(0o644)
        if out.exists():
            out.rmdir()
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
