"""The detokenizer's tokenizer: read straight from tokenizer.json, it decodes exactly as the
transformers tokenizer of the same checkpoint, without importing transformers; a checkpoint
whose tokenizer_config.json adds tokens that tokenizer.json lacks goes through transformers."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.text import IncrementalDetokenizer
from engine.text.hf_tokenizer import load_token_decoder
from tests.checkpoints import tiny_checkpoint
from tests.fresh_process import imported_after


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_decoding_equals_transformers_on_the_same_checkpoint(arch: str) -> None:
    path = str(tiny_checkpoint(arch))
    decoder = load_token_decoder(path)
    reference = AutoTokenizer.from_pretrained(path)
    assert not hasattr(decoder, "apply_chat_template")  # the fast path, not transformers
    rng = random.Random(0)
    text = "Once upon a time, héllo wörld 🙂 — a café"
    sequences = [reference.encode(text), [rng.randrange(len(reference)) for _ in range(200)]]
    sequences.append(reference.all_special_ids + sequences[0])
    for ids in sequences:
        for skip in (True, False):
            ours = decoder.decode(ids, skip_special_tokens=skip)
            theirs = reference.backend_tokenizer.decode(ids, skip_special_tokens=skip)
            assert ours == theirs
        streamed = IncrementalDetokenizer(decoder, [])
        text_out = "".join(streamed.step(i) for i in ids) + streamed.flush()
        assert text_out == reference.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )


def test_added_tokens_missing_from_tokenizer_json_go_through_transformers(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("qwen3"), path)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    new_id = str(len(AutoTokenizer.from_pretrained(str(path))))
    config.setdefault("added_tokens_decoder", {})[new_id] = {
        "content": "<|only_in_config|>",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }
    config_path.write_text(json.dumps(config))
    decoder = load_token_decoder(str(path))
    assert hasattr(decoder, "backend_tokenizer")  # transformers' tokenizer
    assert decoder.decode([int(new_id)], skip_special_tokens=False) == "<|only_in_config|>"


def test_the_fast_path_imports_no_transformers() -> None:
    code = (
        "from engine.text.hf_tokenizer import load_token_decoder\n"
        f"load_token_decoder({str(tiny_checkpoint('qwen3'))!r}).decode([5, 6, 7])"
    )
    assert imported_after(code, ("transformers", "torch")) == []
