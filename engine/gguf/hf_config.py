"""A GGUF file's metadata as the Hugging Face `config.json` and `generation_config.json` the rest
of the engine reads (engine/model/config.py), for the architectures the decoder runs.

llama.cpp's converter writes the model's shape under `<arch>.*` keys; what it does not write
(biases, qk-norm, tied embeddings) shows in which tensors the file holds."""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.gguf.family_config import ARCHITECTURES, family_config
from engine.gguf.metadata import GGUFError
from engine.gguf.reader import GGUFFile


def architecture_of(gguf: GGUFFile) -> str:
    arch = gguf.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{gguf.path}: architecture {arch!r} is not supported; "
            f"supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return str(arch)


def hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """config.json for the file's model (float32: the weights are dequantized at load)."""
    arch = architecture_of(gguf)
    meta = gguf.metadata

    def need(key: str) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise GGUFError(f"{gguf.path}: metadata key {arch}.{key} is missing")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    vocab = _vocab_size(gguf, arch, hidden)
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": int(need("block_count")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        "head_dim": int(meta.get(f"{arch}.attention.key_length") or hidden // heads),
        "rms_norm_eps": _decimal(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _decimal(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length")),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors,
        "mlp_bias": "blk.0.ffn_gate.bias" in gguf.tensors,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        **_special_ids(meta),
    }
    scaling = _rope_scaling(gguf, arch)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config | family_config(gguf, arch, config)


# The sampling defaults a GGUF file may carry (llama.cpp's general.sampling.* keys, which
# llama-server applies) → generation_config.json's keys.
_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
    "general.sampling.penalty_last_n": "repeat_last_n",
}


def generation_config(gguf: GGUFFile) -> dict[str, Any]:
    """The ids that end a generation: eos and, for chat models, end-of-turn (llama.cpp stops at
    both); and the sampling defaults the file carries, if any."""
    meta = gguf.metadata
    ends = [
        int(meta[key])
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        if meta.get(key) is not None
    ]
    out: dict[str, Any] = {"eos_token_id": sorted(set(ends))}
    if meta.get("tokenizer.ggml.bos_token_id") is not None:
        out["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    for key, name in _SAMPLING_KEYS.items():
        value = meta.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = value if isinstance(value, int) else _decimal(value)
    window = out.pop("repeat_last_n", None)
    if window is not None and window >= 1:
        out["repeat_last_n"] = window
    elif window == 0:  # llama.cpp's "no penalty" (and -1, the whole context: vLLM's rule)
        out["repetition_penalty"] = 1.0
    return out


def _decimal(value: float) -> float:
    """A float32 from the file as the decimal it was written from (1e-06, not 9.99999997e-07):
    the shortest decimal that is the same float32 (numpy prints exactly that)."""
    return float(str(np.float32(value)))


def _vocab_size(gguf: GGUFFile, arch: str, hidden: int) -> int:
    embedding = gguf.tensors.get("token_embd.weight")
    if embedding is None:
        raise GGUFError(f"{gguf.path}: no token_embd.weight tensor")
    if len(embedding.shape) != 2 or embedding.shape[1] != hidden:
        raise GGUFError(
            f"{gguf.path}: token_embd.weight has shape {embedding.shape}; expected "
            f"(vocabulary, {hidden}) from {arch}.embedding_length"
        )
    rows = embedding.shape[0]
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    declared = gguf.metadata.get(f"{arch}.vocab_size")
    for what, size in (
        ("tokenizer.ggml.tokens", None if tokens is None else len(tokens)),
        (f"{arch}.vocab_size", declared),
    ):
        if size is not None and int(size) != rows:
            raise GGUFError(
                f"{gguf.path}: {what} has {size} entries but token_embd.weight has {rows} rows"
            )
    return rows


def _special_ids(meta: dict[str, Any]) -> dict[str, Any]:
    ids = {}
    for name in ("bos", "eos", "padding"):
        value = meta.get(f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            ids["pad_token_id" if name == "padding" else f"{name}_token_id"] = int(value)
    return ids


def _rope_scaling(gguf: GGUFFile, arch: str) -> dict[str, Any] | None:
    meta = gguf.metadata
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in gguf.tensors:
        # llama3-style scaling, stored as per-frequency factors instead of its parameters.
        raise GGUFError(
            f"{gguf.path}: tensor rope_freqs.weight (llama3 rope scaling as stored frequency "
            "factors) is not supported; supported: rope.scaling.type none or linear"
        )
    if kind in ("none", None):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    raise GGUFError(
        f"{gguf.path}: {arch}.rope.scaling.type {kind!r} is not supported; supported: none, linear"
    )
