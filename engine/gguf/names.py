"""GGUF tensor names onto the Hugging Face checkpoint names the loader maps (torch-free: the root
reads a GGUF file's tensor table to plan its memory).

The names depend on the architecture where llama.cpp's converter maps one Hugging Face name to
different GGUF names: Gemma's four norms per layer, Phi-3's fused q|k|v and gate|up. A MoE
file stacks each layer's experts into one 3-D tensor (`ffn_gate_exps` [experts, rows,
columns]); its name maps to a template with `{expert}` that engine/gguf/weights.py expands to
each expert's Hugging Face name.
"""

from __future__ import annotations

import re

EXPERT = "{expert}"  # in a name: one tensor per expert, stacked along the first dimension

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a MoE layer's router
    "ffn_gate_exps": f"mlp.experts.{EXPERT}.gate_proj",
    "ffn_up_exps": f"mlp.experts.{EXPERT}.up_proj",
    "ffn_down_exps": f"mlp.experts.{EXPERT}.down_proj",
}
_GEMMA_PARTS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCH_PARTS = {
    "gemma2": _GEMMA_PARTS,
    "gemma3": _GEMMA_PARTS,
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_name(gguf_name: str, arch: str = "") -> str | None:
    """The Hugging Face name of a GGUF tensor of a file of `arch` (its general.architecture);
    None for one the decoder has no use for."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match is None:
        return None
    layer, part, kind = match.groups()
    name = _ARCH_PARTS.get(arch, {}).get(part) or _LAYER_PARTS.get(part)
    return None if name is None else f"model.layers.{layer}.{name}.{kind}"
