"""The built tokenizer a tokenizer actor saves for its restarts (engine/text/hf_tokenizer.py):
a successor encodes text prompts from it exactly as the transformers tokenizer that saved it,
without importing transformers; a tokenizer whose encode is not its backend's is not saved."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.runtime.private_files import ForeignFileError
from engine.text.hf_tokenizer import (
    load_text_encoder,
    load_tokenizer_without_torch,
    remove_text_encoder,
    save_text_encoder,
)
from tests.checkpoints import tiny_checkpoint
from tests.fresh_process import imported_after

TEXTS = [
    "Hello world",
    "  two leading spaces, then\ttabs\n\nand blank lines",
    "<|im_start|>user\nwritten as text<|im_end|>",
    "ünïcödé 日本語 🙂 and digits 1234567890",
    "",
]


def test_a_successor_encodes_text_as_the_tokenizer_that_saved_it(tmp_path: Path) -> None:
    tokenizer = load_tokenizer_without_torch(str(tiny_checkpoint("qwen3")))
    path = str(tmp_path / "engine-1-tokenizer-x")
    assert save_text_encoder(tokenizer, path)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    encoder = load_text_encoder(path)
    assert encoder is not None
    for text in TEXTS:
        assert encoder.encode(text) == tokenizer.encode(text), text
        assert encoder.encode(text, False) == tokenizer.encode(text, add_special_tokens=False)
    code = f"from engine.text.hf_tokenizer import load_text_encoder\nload_text_encoder({path!r})"
    assert imported_after(code, ("transformers", "torch")) == []
    remove_text_encoder(path)
    assert os.listdir(tmp_path) == [] and load_text_encoder(path) is None


def test_a_tokenizer_whose_encode_is_not_its_backends_is_not_saved(tmp_path: Path) -> None:
    class Lowercasing:  # Python-side processing a successor's backend would not repeat
        def __init__(self, inner: object) -> None:
            self.inner = inner
            self.backend_tokenizer = inner.backend_tokenizer  # type: ignore[attr-defined]

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return self.inner.encode(text.lower(), add_special_tokens=add_special_tokens)  # type: ignore[attr-defined,no-any-return]

    tokenizer = load_tokenizer_without_torch(str(tiny_checkpoint("qwen3")))
    path = str(tmp_path / "saved")
    assert not save_text_encoder(Lowercasing(tokenizer), path)
    assert not save_text_encoder(object(), path)
    assert os.listdir(tmp_path) == []


def test_a_saved_tokenizer_that_is_a_link_or_another_users_is_refused(tmp_path: Path) -> None:
    """What a restarted tokenizer would encode prompts with: only a file this run wrote."""
    tokenizer = load_tokenizer_without_torch(str(tiny_checkpoint("qwen3")))
    saved, link = tmp_path / "tokenizer-saved", tmp_path / "tokenizer-link"
    assert save_text_encoder(tokenizer, str(saved))
    os.symlink(saved, link)
    with pytest.raises(ForeignFileError, match="a symbolic link"):
        load_text_encoder(str(link))
    if os.getuid() != 0:
        pytest.skip("needs root, to give the saved file to another uid")
    os.chown(saved, 65534, 65534)
    with pytest.raises(ForeignFileError, match=r"owned by .*65534"):
        load_text_encoder(str(saved))
