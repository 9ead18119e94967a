"""A rank's weights kept for its restarts (engine/model/loading/weight_store.py): the first start
stores what it read from the checkpoint, a later start with the same settings maps that instead of
reading the checkpoint (here: the checkpoint is gone by then) and computes the same logits; other
settings get a segment of their own, and a segment is refused for weights it does not hold, for
another run, or when it is not a file of ours (as root: one chowned to `nobody`)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.model.loading.weight_store import LoadedWeights, StoreSlot
from engine.model.runner import ModelRunner
from engine.model.step_inputs import SeqChunk
from engine.runtime.private_files import ForeignFileError
from engine.runtime.shm import run_directory
from tests.checkpoints import tiny_checkpoint

CHUNK = SeqChunk(
    seq_id=1, token_ids=list(range(3, 40)), start_pos=0, block_table=[0, 1, 2], sample=True
)


def start(path: Path, quantization: str) -> ModelRunner:
    """A worker rank's start in a run rooted in this process."""
    return ModelRunner(
        str(path),
        kv_cache_memory=1 << 20,
        quantization=quantization,
        weights_of_run=run_directory(),
    )


@pytest.mark.parametrize("quantization", ["none", "q4_1"])
def test_a_restart_maps_the_stored_weights_without_the_checkpoint(
    tmp_path: Path, quantization: str
) -> None:
    checkpoint = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("qwen3"), checkpoint)
    first = start(checkpoint, quantization)
    slot = first.weight_slot
    assert slot is not None and os.path.exists(slot.path)
    try:
        expected = first.forward([CHUNK])
        (checkpoint / "model.safetensors").unlink()  # a restart that read it would fail
        restarted = start(checkpoint, quantization)
        assert restarted.weight_slot is not None and restarted.weight_slot.path == slot.path
        assert torch.equal(restarted.forward([CHUNK]), expected)
        assert restarted.model.weight_formats == first.model.weight_formats
        if quantization == "none":
            with pytest.raises(FileNotFoundError, match="no weights"):
                start(checkpoint, "q8_0")  # other settings: another segment, read afresh
    finally:
        slot.remove()
    assert not os.path.exists(slot.path)


def test_a_segment_holding_other_weights_is_refused(tmp_path: Path) -> None:
    checkpoint = tiny_checkpoint("qwen3")
    first = start(checkpoint, "none")
    assert first.weight_slot is not None
    try:
        other = StoreSlot(run_directory(), "another model")
        other.path = first.weight_slot.path
        with pytest.raises(ValueError, match="weight segment holds"):
            other.load()
    finally:
        first.weight_slot.remove()


@pytest.fixture
def stored() -> Iterator[StoreSlot]:
    """A slot of this run holding one small tensor."""
    slot = StoreSlot(run_directory(), "one tensor")
    slot.save(LoadedWeights({"w": torch.arange(64, dtype=torch.float32)}, {}, {}))
    yield slot
    slot.remove()


def test_a_segment_of_another_run_is_refused(stored: StoreSlot) -> None:
    other_run = StoreSlot(f"engine-{os.getpid()}-00000000000000ff", stored.identity)
    other_run.path = stored.path
    with pytest.raises(ValueError, match="another run"):
        other_run.load()
    loaded = stored.load()
    assert loaded is not None and torch.equal(loaded.params["w"], torch.arange(64.0))


@pytest.mark.skipif(os.getuid() != 0, reason="needs root, to give the file to another uid")
def test_a_segment_another_user_owns_is_refused_naming_the_owner(stored: StoreSlot) -> None:
    os.chown(stored.path, 65534, 65534)
    with pytest.raises(ForeignFileError, match=rf"refusing {stored.path}: owned by .*65534"):
        stored.load()
