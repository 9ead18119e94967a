"""GGUF files of the families' tiny checkpoints (tests/unit/test_families.py), written with the
`gguf` package the way llama.cpp's convert_hf_to_gguf.py writes them: its own tensor-name map
(gguf.get_tensor_name_map), each layer's experts stacked into one 3-D tensor, Gemma's norms
stored as 1 + w, Phi-3's longrope factors as tensors, llama's q/k rows permuted, and the keys
its converter classes write for each architecture. Checked by hand once against the real
converter of llama-cpp-python 0.3.36 (docs/models.md says how).

Beside each file, the same weights after the same quantization, in the Hugging Face layout
(the reference both the engine's safetensors load and transformers read).
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
from tests.gguf_files import _permute, _quantize, _write_tokenizer

# Hugging Face class -> (GGUF architecture, gguf.MODEL_ARCH member)
ARCHES = {
    "MistralForCausalLM": ("llama", "LLAMA"),
    "MixtralForCausalLM": ("llama", "LLAMA"),
    "Phi3ForCausalLM": ("phi3", "PHI3"),
    "Gemma2ForCausalLM": ("gemma2", "GEMMA2"),
    "Gemma3ForCausalLM": ("gemma3", "GEMMA3"),
    "Qwen3MoeForCausalLM": ("qwen3moe", "QWEN3MOE"),
    "OlmoeForCausalLM": ("olmoe", "OLMOE"),
}


def family_gguf(checkpoint: Path, quant: str = "F32") -> tuple[Path, Path]:
    """(the GGUF file of `checkpoint` with its matrices in type `quant`, the directory holding
    the same weights dequantized in the Hugging Face layout); cached like the checkpoints."""
    key = hashlib.sha256(
        f"{checkpoint}\0{quant}\0".encode() + Path(__file__).read_bytes()
    ).hexdigest()[:16]
    target = CACHE_ROOT / f"family-gguf-{checkpoint.name}-{quant}-{key}"
    if not (target / "model.gguf").is_file():
        build_directory(target, lambda staging: _write(checkpoint, quant, staging), "model.gguf")
    return target / "model.gguf", target / "reference"


def _write(checkpoint: Path, quant: str, out: Path) -> None:
    import gguf

    config = json.loads((checkpoint / "config.json").read_text())
    arch, member = ARCHES[config["architectures"][0]]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[member], config["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(out / "model.gguf"), arch)
    _write_config(writer, arch, config)
    _write_tokenizer(writer, checkpoint)
    reference: dict[str, torch.Tensor] = {}
    kind = gguf.GGMLQuantizationType[quant]
    for name, tensor in _stacked_experts(load_file(str(checkpoint / "model.safetensors"))):
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        array = tensor.float().numpy()
        qtype = kind if array.ndim >= 2 else gguf.GGMLQuantizationType.F32
        stored = _quantize(array, qtype)
        back = gguf.quants.dequantize(stored, qtype).reshape(array.shape)
        reference.update(_unstacked(name, torch.from_numpy(np.ascontiguousarray(back))))
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            stored = stored + 1  # Gemma's (1 + w), as the converter stores it
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config[
                "num_attention_heads" if "attn_q" in gguf_name else "num_key_value_heads"
            ]
            stored = _quantize(_permute(array, heads), qtype)
        writer.add_tensor(gguf_name, stored, raw_dtype=qtype)
    for gguf_name, factors in _longrope_tensors(config):
        writer.add_tensor(gguf_name, factors, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ref = out / "reference"
    shutil.copytree(checkpoint, ref, ignore=shutil.ignore_patterns("model.safetensors"))
    save_file(reference, str(ref / "model.safetensors"))


def _stacked_experts(weights: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each layer's experts stacked along a first dimension under
    the merged name the converter gives them (...experts.gate_proj.weight, ...experts.w1.weight)."""
    out: list[tuple[str, torch.Tensor]] = []
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name in sorted(weights):
        head, sep, tail = name.partition(".experts.")
        if not sep:
            out.append((name, weights[name]))
            continue
        index, _, part = tail.partition(".")
        experts.setdefault(f"{head}.experts.{part}", {})[int(index)] = weights[name]
    for merged, by_index in experts.items():
        out.append((merged, torch.stack([by_index[i] for i in sorted(by_index)])))
    return out


def _unstacked(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    if ".experts." not in name:
        return {name: tensor}
    head, _, part = name.partition(".experts.")
    return {f"{head}.experts.{i}.{part}": tensor[i].clone() for i in range(tensor.shape[0])}


def _longrope_tensors(config: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") != "longrope":
        return []
    return [
        ("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)),
        ("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32)),
    ]


def _write_config(writer: Any, arch: str, config: dict[str, Any]) -> None:
    """The keys the converter's TextModel.set_gguf_parameters and the architecture's class
    write."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}
    global_rope = rope.get("full_attention", rope)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(global_rope.get("rope_theta", 10000.0))
    writer.add_vocab_size(config["vocab_size"])
    if global_rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf_rope_linear())
        writer.add_rope_scaling_factor(global_rope["factor"])
    if "sliding_attention" in rope:
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if config.get("sliding_window") is not None:
        writer.add_sliding_window(config["sliding_window"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key) is not None:
            getattr(writer, f"add_{key}")(config[key])
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if config.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if arch == "phi3":
        fraction = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(int(fraction * head_dim))
        if rope.get("rope_type") == "longrope":
            original = rope["original_max_position_embeddings"]
            writer.add_rope_scaling_orig_ctx_len(original)
            scale = config["max_position_embeddings"] / original
            writer.add_rope_scaling_attn_factors(
                1.0 if scale <= 1.0 else float(np.sqrt(1 + np.log(scale) / np.log(original)))
            )


def gguf_rope_linear() -> Any:
    import gguf

    return gguf.RopeScalingType.LINEAR
