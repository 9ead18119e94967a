"""Tiny GGUF files for tests, written with the `gguf` package (llama.cpp's own writer) from a
random checkpoint of tests/checkpoints.py, the way llama.cpp's converter writes them: llama's q and
k rows permuted, weights quantized by `gguf.quants.quantize`, the tokenizer as `tokenizer.ggml.*`.

Beside each file, the same weights after the same quantization (`gguf.quants.dequantize`) in the
Hugging Face layout, for the reference loads: the engine's safetensors path and transformers.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from engine.settings.home import build_directory
from tests.checkpoints import CACHE_ROOT

ARCH_NAMES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_LAYER_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_of(checkpoint: Path, quant: str, **metadata_overrides: Any) -> tuple[Path, Path]:
    """(a GGUF file of `checkpoint` with its 2-D weights in type `quant`, the directory holding
    the same weights dequantized in the Hugging Face layout). Cached like the checkpoints.

    `quant` may mix types the way llama.cpp's Q4_K_M files do: "Q4_0,attn_v=Q8_0" writes every
    2-D weight in Q4_0 but the tensors whose GGUF name has the part `attn_v`, in Q8_0."""
    key = hashlib.sha256(
        f"{checkpoint}\0{quant}\0{json.dumps(metadata_overrides, sort_keys=True)}\0".encode()
        + Path(__file__).read_bytes()
    ).hexdigest()[:16]
    target = CACHE_ROOT / f"gguf-{checkpoint.name}-{quant}-{key}"
    if not (target / "model.gguf").is_file():
        build_directory(
            target,
            lambda staging: _write(checkpoint, quant, staging, metadata_overrides),
            "model.gguf",
        )
    return target / "model.gguf", target / "reference"


def _write(checkpoint: Path, quant: str, out: Path, overrides: dict[str, Any]) -> None:
    import gguf

    overrides = dict(overrides)

    config = json.loads((checkpoint / "config.json").read_text())
    # A file may claim another architecture (`general.architecture`) to test its refusal.
    arch = overrides.pop("general.architecture", None) or ARCH_NAMES[config["architectures"][0]]
    weights = load_file(str(checkpoint / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out / "model.gguf"), arch)
    _write_config(writer, arch, config, overrides.pop(f"{arch}.vocab_size", config["vocab_size"]))
    _write_tokenizer(writer, checkpoint)
    for key, value in overrides.items():
        writer.add_key_value(key, value, _value_type(value))
    reference: dict[str, torch.Tensor] = {}
    default, *special = quant.split(",")
    by_part = dict(item.split("=") for item in special)
    for name, tensor in weights.items():
        array = tensor.float().numpy()
        part = _gguf_name(name).split(".")[-2]
        qtype = gguf.GGMLQuantizationType[by_part.get(part, default)]
        kind = qtype if array.ndim == 2 else gguf.GGMLQuantizationType.F32
        # What the file will hold, back as float: the reference both other loads read.
        stored = _quantize(array, kind)
        reference[name] = torch.from_numpy(
            np.ascontiguousarray(gguf.quants.dequantize(stored, kind).reshape(array.shape))
        )
        gguf_name = _gguf_name(name)
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            # Rows are quantized one by one, so permuting before quantizing stores exactly the
            # permuted rows of `stored`.
            heads = config[
                "num_attention_heads" if "attn_q" in gguf_name else "num_key_value_heads"
            ]
            stored = _quantize(_permute(array, heads), kind)
        writer.add_tensor(gguf_name, stored, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ref = out / "reference"
    shutil.copytree(checkpoint, ref, ignore=shutil.ignore_patterns("model.safetensors"))
    save_file(reference, str(ref / "model.safetensors"))


def _quantize(array: np.ndarray, kind: Any) -> np.ndarray:
    import gguf

    if kind == gguf.GGMLQuantizationType.F32:
        return array
    return gguf.quants.quantize(array, kind)


def _write_config(writer: Any, arch: str, config: dict[str, Any], vocab_size: int) -> None:
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(
        config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    )
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_vocab_size(vocab_size)
    scaling = config.get("rope_scaling")
    if scaling:
        writer.add_rope_scaling_type(scaling["rope_type"])
        writer.add_rope_scaling_factor(scaling["factor"])


def _write_tokenizer(writer: Any, checkpoint: Path) -> None:
    import gguf

    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    tokenizer_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    vocab: dict[str, int] = dict(tokenizer["model"]["vocab"])
    added = {token["content"]: token["id"] for token in tokenizer["added_tokens"]}
    tokens = [""] * (max([*vocab.values(), *added.values()]) + 1)
    types = [gguf.TokenType.NORMAL] * len(tokens)
    for token, token_id in vocab.items():
        tokens[token_id] = token
    for token, token_id in added.items():
        tokens[token_id] = token
        types[token_id] = gguf.TokenType.CONTROL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    eos = generation.get("eos_token_id")
    writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    writer.add_add_bos_token(False)
    if tokenizer_config.get("chat_template"):
        writer.add_chat_template(tokenizer_config["chat_template"])


def _gguf_name(name: str) -> str:
    name = name.removeprefix("model.")
    globals_ = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
    if name in globals_:
        return globals_[name]
    if name == "lm_head.weight":
        return "output.weight"
    _, layer, rest = name.split(".", 2)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_PARTS[part]}.{kind}"


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute` of q/k rows for its rotary layout."""
    shape = weights.shape
    return (
        weights.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    )


def _value_type(value: Any) -> Any:
    import gguf

    if isinstance(value, bool):
        return gguf.GGUFValueType.BOOL
    if isinstance(value, int):
        return gguf.GGUFValueType.UINT32
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32
    return gguf.GGUFValueType.STRING
