"""A GGUF file's repacked weights kept on disk (engine/model/loading/weight_cache.py): the first
start writes them beside what is derived from the file, owner-only; a later start maps them
(nothing is repacked) and computes the same logits; a file at that name that is a link, not
owner-only or someone else's is never mapped, and the start reads the GGUF file instead."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from engine.gguf.checkpoint import prepare_checkpoint
from engine.kernels.cpu import quantized
from engine.model.loading.weight_cache import PREFIX, CacheSlot
from engine.model.runner import ModelRunner
from engine.model.step_inputs import SeqChunk
from tests.checkpoints import tiny_checkpoint
from tests.gguf_files import gguf_of

CHUNK = SeqChunk(
    seq_id=1, token_ids=list(range(3, 40)), start_pos=0, block_table=[0, 1, 2], sample=True
)


def start(path: Path, quantization: str = "auto") -> ModelRunner:
    return ModelRunner(str(path), kv_cache_memory=1 << 20, quantization=quantization)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    gguf_file, _ = gguf_of(tiny_checkpoint("llama"), "Q4_0,attn_v=Q8_0")
    return prepare_checkpoint(gguf_file, tmp_path)


def cache_files(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"{PREFIX}*"))


def test_a_later_start_maps_the_repacked_weights(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = start(checkpoint)
    assert isinstance(first.weight_slot, CacheSlot)
    (written,) = cache_files(checkpoint)
    assert stat.S_IMODE(written.stat().st_mode) == 0o600 and written.is_file()
    expected = first.forward([CHUNK])

    def no_repacking(*args: object) -> None:
        raise AssertionError("repacked at a later start")

    monkeypatch.setattr(quantized, "pack_gguf", no_repacking)
    later = start(checkpoint)
    assert torch.equal(later.forward([CHUNK]), expected)
    assert later.model.weight_formats == first.model.weight_formats
    later.weight_slot.remove()  # type: ignore[union-attr]  # kept for the next start
    assert cache_files(checkpoint) == [written]
    # Dequantized weights are not repacked ones: nothing on disk for them.
    assert start(checkpoint, "none").weight_slot is None


def test_a_file_at_the_name_that_is_not_ours_alone_is_never_mapped(
    checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    expected = start(checkpoint).forward([CHUNK])
    (written,) = cache_files(checkpoint)
    os.chmod(written, 0o644)
    with caplog.at_level("WARNING", logger="engine.model.loading.weight_cache"):
        again = start(checkpoint)
    assert "mode 0644 lets other users in" in caplog.text
    assert torch.equal(again.forward([CHUNK]), expected)  # read from the GGUF file instead
    assert stat.S_IMODE(written.stat().st_mode) == 0o644  # and the file at the name left alone


def test_a_link_at_the_name_is_not_followed(
    checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    expected = start(checkpoint).forward([CHUNK])
    (written,) = cache_files(checkpoint)
    moved = tmp_path / "elsewhere.weights"
    written.rename(moved)
    written.symlink_to(moved)
    with caplog.at_level("WARNING", logger="engine.model.loading.weight_cache"):
        again = start(checkpoint)
    assert "a symbolic link" in caplog.text
    assert torch.equal(again.forward([CHUNK]), expected)
    assert written.is_symlink()


def test_a_file_holding_other_weights_is_refused(checkpoint: Path) -> None:
    first = start(checkpoint)
    assert first.weight_slot is not None
    other = CacheSlot(checkpoint, "another model")
    other.path = first.weight_slot.path
    with pytest.raises(ValueError, match="weight segment holds"):
        other.load()
