"""One server for the many-models tests (issue 48): a command-line model ("main", a tiny
Qwen3 checkpoint) and a --models-dir holding a Hugging Face directory ("llama", alias
"llama:tiny"), a GGUF file of it ("llama-q8"), a fourth model ("qwen2") and one that cannot
load ("broken"), at most three loaded at once, kept until unloaded (--keep-alive -1). Prompts
holding tests/holds.py's HOLD_TEXT are held in flight while a test acts on them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.checkpoints import tiny_checkpoint
from tests.e2e.conftest import server_args
from tests.e2e.harness import Server, served
from tests.gguf_files import gguf_of
from tests.holds import hold_env


@pytest.fixture(scope="package")
def checkpoints() -> dict[str, Path]:
    """Each model's reference checkpoint (the GGUF file's: its weights as the file holds them)."""
    llama = tiny_checkpoint("llama", tie_word_embeddings=True)
    gguf, reference = gguf_of(llama, "Q8_0")
    return {
        "main": tiny_checkpoint("qwen3"),
        "llama": llama,
        "llama-q8": reference,
        "qwen2": tiny_checkpoint("qwen2"),
        "gguf-file": gguf,
    }


@pytest.fixture(scope="package")
def models(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("models")
    (directory / "llama").symlink_to(checkpoints["llama"])
    (directory / "llama-q8.gguf").symlink_to(checkpoints["gguf-file"])
    (directory / "qwen2").symlink_to(checkpoints["qwen2"])
    broken = directory / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"]}))
    (directory / "models.toml").write_text('[llama]\naliases = ["llama:tiny"]\n')
    args = server_args(["--model", str(checkpoints["main"])], None)
    args += ["--served-model-name", "main", "--models-dir", str(directory)]
    args += ["--max-loaded-models", "3", "--keep-alive", "-1"]
    with served(args, directory, hold_env(), name="models") as server:
        yield server
