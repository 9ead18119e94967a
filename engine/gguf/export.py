"""`engine export FILE.gguf DIR`: a GGUF file as a float32 Hugging Face checkpoint (config,
generation config, tokenizer with its chat template, model.safetensors), for peers that cannot
read GGUF, vLLM on the CPU among them. The weights are the file's, dequantized, with llama's q/k
rows back in Hugging Face order: what the engine itself serves from the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from engine.gguf.checkpoint import write_hf_files
from engine.gguf.metadata import GGUFError
from engine.gguf.reader import read_gguf
from engine.gguf.weights import GGUFTensors
from engine.settings.home import build_directory


def export_checkpoint(gguf_path: Path, out: Path) -> None:
    """Write the checkpoint into `out` (created; refused if it exists and is not empty)."""
    if out.exists() and any(out.iterdir()):
        raise GGUFError(f"{out} exists and is not empty: name a new directory")

    def export(staging: Path) -> None:
        with read_gguf(gguf_path) as gguf:
            write_hf_files(gguf, staging)
            tensors = GGUFTensors(gguf)
            weights = {
                name: np.ascontiguousarray(tensors.rows(name, 0, tensors.shape(name)[0]))
                for name in tensors.keys()  # noqa: SIM118 (not a dict)
            }
            save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "model.safetensors").chmod(0o644)

    # An empty `out` is replaced whole by the rename.
    build_directory(out, export, "model.safetensors")
