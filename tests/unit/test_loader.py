"""Loading checkpoints: config parsing (both rope formats), sharded weights, dtype choice, and
clear errors for what is not supported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.model.config import load_model_config, parse_model_config
from engine.model.loading.loader import resolve_dtype
from engine.model.placement.policy import dtype_note
from engine.model.runner import ModelRunner
from engine.model.step_inputs import SeqChunk
from tests.checkpoints import tiny_checkpoint
from tests.fresh_process import imported_after

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 4096,
}


def test_sharded_checkpoint_loads_identically_to_single_file() -> None:
    single = ModelRunner(str(tiny_checkpoint("qwen3")), kv_cache_memory=1 << 20)
    sharded_path = tiny_checkpoint("qwen3", max_shard_size="30KB")
    assert (sharded_path / "model.safetensors.index.json").is_file()
    sharded = ModelRunner(str(sharded_path), kv_cache_memory=1 << 20)
    ours = dict(single.model.named_parameters())
    theirs = dict(sharded.model.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, param in ours.items():
        assert torch.equal(param, theirs[name]), name
    chunk = [SeqChunk(0, [5, 6, 7, 8], 0, [0], True)]
    assert torch.equal(single.forward(chunk), sharded.forward(chunk))


def test_unsupported_architecture_lists_the_supported_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "architectures": ["GPT2LMHead"]}))
    with pytest.raises(ValueError) as error:
        load_model_config(tmp_path)
    message = str(error.value)
    assert "GPT2LMHead" in message
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in message


def test_missing_weights_are_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    source = tiny_checkpoint("llama")
    for name in ("config.json", "generation_config.json"):
        shutil.copy(source / name, tmp_path / name)
    weights = load_file(source / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks weights: layers\.1\.self_attn\.qkv_proj\.weight"):
        ModelRunner(str(tmp_path), kv_cache_memory=1 << 20)


def test_missing_checkpoint_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        ModelRunner(str(tmp_path / "nowhere"))


def test_transformers4_and_5_rope_formats_parse_the_same() -> None:
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    old = parse_model_config(
        {**BASE, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **scaling}}
    )
    new = parse_model_config(
        {**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **scaling}}
    )
    assert old == new
    assert new.rope_theta == 500000.0 and new.rope_scaling is not None
    assert new.rope_scaling.rope_type == "llama3" and new.rope_scaling.factor == 8.0
    linear = parse_model_config({**BASE, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert linear.rope_scaling is not None and linear.rope_scaling.rope_type == "linear"
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        parse_model_config({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_config_fields_max_model_len_and_eos_ids() -> None:
    config = load_model_config(tiny_checkpoint("qwen2"), max_model_len=100_000)
    assert config.max_model_len == config.max_position_embeddings == 4096
    assert load_model_config(tiny_checkpoint("qwen2"), max_model_len=64).max_model_len == 64
    assert config.eos_token_ids == (0, 2)  # <|endoftext|>, <|im_end|> from generation_config
    assert config.qkv_bias and not config.o_bias and not config.qk_norm
    assert config.head_dim == 16 and config.num_kv_heads == 2
    qwen3 = parse_model_config({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert qwen3.qk_norm and qwen3.head_dim == 32


def test_dtype_resolution_per_device() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    fp16 = parse_model_config({**BASE, "torch_dtype": "float16"})
    bf16 = parse_model_config({**BASE, "dtype": "bfloat16"})
    fp32 = parse_model_config({**BASE, "torch_dtype": "float32"})
    assert resolve_dtype("auto", fp16, cpu) == torch.float32
    assert resolve_dtype("auto", bf16, cpu) == torch.bfloat16
    assert resolve_dtype("auto", fp32, cuda) == torch.bfloat16
    assert resolve_dtype("auto", fp16, cuda) == torch.float16
    assert resolve_dtype("bfloat16", fp32, cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="'float16' is not supported on cpu"):
        resolve_dtype("float16", fp32, cpu)
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        resolve_dtype("int8", fp32, cpu)
    # the start log's line says where auto differs from vLLM-CPU's, and what gives its choice
    assert dtype_note("auto", "bfloat16", "bfloat16", "cpu", False) == (
        "dtype: bfloat16 (--dtype auto; the checkpoint's bfloat16)"
    )
    for theirs in ("float32", "float16"):
        note = dtype_note("auto", theirs, "float32", "cpu", False)
        vllm = "float16" if theirs == "float16" else "bfloat16"
        assert f"vLLM-CPU's --dtype auto serves it in {vllm}: --dtype bfloat16" in note
    assert "vLLM" not in dtype_note("auto", "float32", "float32", "cpu", True)  # GGUF
    assert "vLLM" not in dtype_note("float32", "float32", "float32", "cpu", False)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_loading_imports_neither_dynamo_nor_sympy(arch: str) -> None:
    """A worker (re)start pays for what loading imports: ops on meta tensors would pull in
    torch._dynamo and sympy (seconds), so the loader runs none. Checked in a fresh process."""
    code = (
        "from engine.model.runner import ModelRunner\n"
        f"ModelRunner({str(tiny_checkpoint(arch))!r}, kv_cache_memory=1 << 20)"
    )
    assert imported_after(code, ("torch._dynamo", "sympy")) == []
