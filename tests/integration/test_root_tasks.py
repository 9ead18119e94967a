"""The root's own tasks (the output pump, restart handling) carry every stream: if one dies the
engine must not go on pretending. It shuts down in order, says why, and every waiting request
gets that reason instead of hanging. The faults are injected into the root's code itself."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from engine import AsyncLLM, EngineError, SamplingParams
from engine.library.llm import build_settings
from tests.checkpoints import tiny_checkpoint

WAIT_S = 60.0


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[AsyncLLM]:
    settings = build_settings(
        **{
            "model.path": str(tiny_checkpoint(arch="qwen3")),
            "model.max_model_len": 256,
            "cache.kv_cache_memory": 4 * 2**20,
        }
    )
    llm = AsyncLLM(settings)
    try:
        await asyncio.wait_for(llm.start(), 180)
        yield llm
    finally:
        await llm.shutdown()


def injected_fault(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("injected fault in the root")


async def assert_shut_down_naming(engine: AsyncLLM, task: str) -> None:
    reason = await asyncio.wait_for(engine.wait_closed(), WAIT_S)
    assert f"{task} task died" in reason and "injected fault" in reason
    assert not engine.health().ready and task in engine.health().reason
    with pytest.raises(EngineError) as refused:
        await asyncio.wait_for(engine.complete("more", SamplingParams(max_tokens=2)), WAIT_S)
    assert refused.value.status == 503


async def test_a_dead_output_pump_fails_the_streams_and_shuts_the_engine_down(
    engine: AsyncLLM,
) -> None:
    engine.gateway.deliver = injected_fault  # type: ignore[method-assign]
    with pytest.raises(EngineError) as failed:
        await asyncio.wait_for(engine.complete("hello", SamplingParams(max_tokens=4)), WAIT_S)
    assert failed.value.status == 503 and "gateway-outputs" in failed.value.message
    await assert_shut_down_naming(engine, "gateway-outputs")


async def test_dead_restart_handling_shuts_the_engine_down(engine: AsyncLLM) -> None:
    engine.gateway.resubmit_all = injected_fault  # type: ignore[method-assign]
    [detokenizer] = [row for row in engine.actors() if row.name == "detokenizer"]
    os.kill(detokenizer.pid, signal.SIGKILL)  # its restart is what the events task handles
    await assert_shut_down_naming(engine, "gateway-events")
