"""tools/data/make_model.py and the checkpoint maker: output loads in transformers, builds are
deterministic, and the built-in demo model is built once per engine home."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.demo.checkpoint_maker import CheckpointSpec, make_checkpoint
from engine.demo.tokenizer_maker import CHATML_TEMPLATE, train_bpe_tokenizer

REPO = Path(__file__).resolve().parents[2]
SMALL = {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 1}


def test_cli_output_loads_in_transformers_with_chat_template(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = tmp_path / "llama"
    subprocess.run(
        [
            sys.executable,
            "tools/data/make_model.py",
            "--out",
            str(out),
            "--arch",
            "llama",
            "--layers",
            "1",
            "--hidden",
            "32",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--vocab",
            "400",
            "--tie",
            "--seed",
            "7",
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=120,
    )
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 1 and model.config.tie_word_embeddings
    assert len(tokenizer) == model.config.vocab_size == 400
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer("The harbour at first light")["input_ids"]
    assert tokenizer.decode(ids) == "The harbour at first light"
    portable = json.loads((out / "tokenizer_config.json").read_text())  # transformers 4 too
    assert portable["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert portable["chat_template"] == CHATML_TEMPLATE
    eos = GenerationConfig.from_pretrained(out).eos_token_id
    assert eos == tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    logits = model(torch.tensor([ids])).logits
    assert torch.isfinite(logits).all()


def test_cli_rejects_bad_sizes_naming_them(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "tools/data/make_model.py",
            "--out",
            str(tmp_path / "x"),
            "--heads",
            "3",
            "--kv-heads",
            "2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "num_heads (3) must be a multiple of num_kv_heads (2)" in result.stderr


def test_same_spec_gives_identical_files_and_another_seed_other_weights(tmp_path: Path) -> None:
    spec = CheckpointSpec(arch="qwen2", vocab_size=300, **SMALL)
    a = make_checkpoint(tmp_path / "a", spec)
    b = make_checkpoint(tmp_path / "b", spec)
    c = make_checkpoint(
        tmp_path / "c", CheckpointSpec(arch="qwen2", vocab_size=300, seed=1, **SMALL)
    )
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    weights_a, weights_c = load_file(a / "model.safetensors"), load_file(c / "model.safetensors")
    assert not torch.equal(
        weights_a["model.embed_tokens.weight"], weights_c["model.embed_tokens.weight"]
    )
    # Qwen2's q/k/v biases and the norms are random too, so a loader that drops them is caught.
    bias = weights_a["model.layers.0.self_attn.q_proj.bias"]
    assert bias.abs().sum() > 0
    assert not torch.equal(
        weights_a["model.norm.weight"], torch.ones_like(weights_a["model.norm.weight"])
    )


def test_tokenizer_training_is_deterministic_across_processes() -> None:
    code = (
        "import hashlib; from engine.demo.tokenizer_maker import train_bpe_tokenizer;"
        "print(hashlib.sha256(train_bpe_tokenizer(1000).backend_tokenizer.to_str().encode())"
        ".hexdigest())"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
            env={"PYTHONHASHSEED": str(seed), "PATH": "/usr/bin:/bin"},
        ).stdout
        for seed in (1, 2)
    }
    assert len(digests) == 1


def test_tokenizer_has_exactly_the_requested_vocabulary() -> None:
    big = train_bpe_tokenizer(20000)  # more than the corpus can fill: reserved tokens pad it
    assert len(big) == 20000
    assert big.convert_ids_to_tokens(19999).startswith("<|reserved_")
    assert big.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert big.chat_template == CHATML_TEMPLATE
    with pytest.raises(ValueError, match="vocab_size 100 is too small"):
        train_bpe_tokenizer(100)


def test_sharded_save_writes_an_index(tmp_path: Path) -> None:
    spec = CheckpointSpec(arch="qwen3", vocab_size=300, max_shard_size="20KB", **SMALL)
    out = make_checkpoint(tmp_path / "sharded", spec)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


def test_default_model_is_built_once_per_engine_home(tmp_path: Path) -> None:
    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO);"
        "from engine.demo.default_model import ensure_default_model;"
        "print(ensure_default_model(sys.argv[1]))"
    )
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        outputs = [run.communicate(timeout=240) for run in runs]
    finally:
        for run in runs:
            run.kill()
    paths = {out.strip() for out, _ in outputs}
    assert len(paths) == 1, outputs
    path = Path(paths.pop())
    assert path.parent == tmp_path / "models"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no staging left
    assert "built-in demo model" in outputs[0][1]
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["num_hidden_layers"] == 4
    made = (path / "model.safetensors").stat().st_mtime_ns
    from engine.demo.default_model import ensure_default_model

    assert ensure_default_model(str(tmp_path)) == str(path)
    assert (path / "model.safetensors").stat().st_mtime_ns == made  # cached, not rebuilt
