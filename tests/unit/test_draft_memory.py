"""A draft model's memory (speculative decoding): the launch sizes the KV cache so that the
caches the worker then allocates, the target's and the draft's (as many blocks), fit the budget
together, and the weights that budget is left after are the target's and the draft's, as
transformers counts their parameters; a restarted worker maps the draft's weights from the run's
store instead of reading its checkpoint, as it does the target's."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from engine.actors.configs import WorkerConfig
from engine.actors.worker import _drafter
from engine.launch.draft import draft_footprint
from engine.launch.plan import plan_engine
from engine.launch.sizing import kv_cache_blocks
from engine.library.llm import build_settings
from engine.model.config import load_model_config
from engine.model.runner import ModelRunner
from engine.model.speculation.drafter import Drafter
from engine.model.step_inputs import SeqChunk
from engine.runtime.shm import run_directory
from tests.checkpoints import hf_model, tiny_checkpoint

MIB = 2**20


@pytest.fixture(scope="module")
def target() -> Path:
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="module")
def draft() -> Path:
    """A draft with fewer KV heads than the target: a KV block of other bytes (and a checkpoint
    other tests build too)."""
    return tiny_checkpoint("qwen3", num_kv_heads=1)


def settings_with(target: Path, draft: Path | None, **fields: Any) -> Any:
    spec = json.dumps({"model": str(draft), "num_speculative_tokens": 3}) if draft else ""
    return build_settings(
        None, **{"model.path": str(target), "scheduler.speculative_config": spec, **fields}
    )


def blocks_bytes(runner: ModelRunner) -> int:
    """What the runner's KV cache allocated for its blocks (its padding slot aside)."""
    cache = runner.kv_cache
    return cache.storage[:, :, : cache.num_slots].nbytes


def test_the_target_and_draft_caches_fit_the_budget_together(target: Path, draft: Path) -> None:
    budget = 3 * MIB
    sized = {"cache.kv_cache_memory": budget}
    plan = plan_engine(settings_with(target, draft, **sized), str(target))
    child = next(c for c in plan.spec.children if c.name.startswith("worker"))
    config = msgspec.msgpack.decode(child.config, type=WorkerConfig)
    runner = ModelRunner(
        str(target), kv_cache_memory=config.kv_cache_memory, block_size=config.block_size
    )
    drafter = Drafter(config.draft_model_path, runner)
    assert plan.num_blocks == runner.num_blocks == drafter.runner.num_blocks
    allocated = blocks_bytes(runner) + blocks_bytes(drafter.runner)
    pair = allocated // plan.num_blocks  # a target block and a draft block
    assert allocated <= budget < allocated + pair  # no room for one more pair
    alone = plan_engine(settings_with(target, None, **sized), str(target))
    assert alone.num_blocks > plan.num_blocks  # the target's cache alone had the budget


def test_the_budget_is_what_the_target_and_draft_weights_leave(target: Path, draft: Path) -> None:
    """On the CPU a rank's weights are the checkpoint's parameters plus packed copies of its
    matmul weights (nn.Linear in transformers' model), float32 here, the draft's counted too."""

    def resident(path: Path) -> int:
        model = hf_model(path)
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        parameters: int = sum(p.numel() for p in model.parameters())
        return 4 * (parameters + sum(m.weight.numel() for m in linears))

    available, fraction = 64 * MIB, 0.5
    settings = settings_with(target, draft, **{"cache.kv_cache_fraction": fraction})
    config = load_model_config(target)
    footprint = draft_footprint(str(draft), settings.cache.block_size, "float32", "cpu")
    assert footprint is not None
    blocks = kv_cache_blocks(
        settings, config, "cpu", "float32", "float32", 1, None, footprint, available
    )
    runner = ModelRunner(str(target), kv_cache_memory=1 << 20, block_size=16)
    drafter = Drafter(str(draft), runner)
    pair = (blocks_bytes(runner) + blocks_bytes(drafter.runner)) // runner.num_blocks
    left = int(available * fraction) - resident(target) - resident(draft)
    assert blocks == left // pair


def test_a_restarted_worker_maps_the_drafts_weights_without_its_checkpoint(
    tmp_path: Path, target: Path, draft: Path
) -> None:
    copy = tmp_path / "draft"
    shutil.copytree(draft, copy)
    runner = ModelRunner(str(target), kv_cache_memory=1 << 20)
    config = WorkerConfig(
        model_path=str(target),
        rank=0,
        world_size=1,
        dtype="float32",
        device="cpu",
        block_size=runner.block_size,
        kv_cache_memory=1 << 20,
        max_model_len=runner.config.max_model_len,
        draft_model_path=str(copy),
    )
    first = _drafter(config, runner, run_directory())
    slot = first.runner.weight_slot
    assert slot is not None and os.path.exists(slot.path)
    chunk = SeqChunk(
        seq_id=1, token_ids=list(range(3, 40)), start_pos=0, block_table=[0, 1, 2], sample=True
    )
    try:
        expected = first.runner.forward([chunk])
        (copy / "model.safetensors").unlink()  # a restart that read it would fail
        restarted = _drafter(config, runner, run_directory())
        assert restarted.runner.weight_slot.path == slot.path
        assert torch.equal(restarted.runner.forward([chunk]), expected)
    finally:
        slot.remove()
    assert not os.path.exists(slot.path)
