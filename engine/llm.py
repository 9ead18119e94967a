"""LLM: the blocking library API over AsyncLLM (as vLLM's `LLM`).

The actor system runs on an event loop in a background thread of the calling process; `close()`
(or leaving the `with` block) stops every actor and removes every segment.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import msgspec
import uvloop

from engine.async_llm import AsyncLLM
from engine.messages.params import SamplingParams
from engine.outputs import RequestOutput
from engine.settings import Settings
from engine.settings.schema import cross_field_problems

T = TypeVar("T")

Prompt = str | list[int]
Conversation = list[Mapping[str, Any]]

START_TIMEOUT_S = 600.0


def build_settings(settings: Settings | None = None, **fields: Any) -> Settings:
    """Settings with `section.field`-style overrides, checked against the schema's bounds."""
    raw = msgspec.to_builtins(settings or Settings())
    for dotted, value in fields.items():
        section, _, name = dotted.partition(".")
        raw[section][name] = value
    try:
        settings = msgspec.convert(raw, Settings)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid setting: {exc}") from None
    for key, problem in cross_field_problems(settings):
        raise ValueError(f"invalid setting {key}: {problem}")
    return settings


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        max_model_len: int | None = None,
        dtype: str = "auto",
        kv_cache_memory: int | None = None,
        seed: int = 0,
        settings: Settings | None = None,
        **options: Any,
    ) -> None:
        """`options` are further settings as `section__field=value`, e.g. `cache__block_size=8`."""
        fields = {
            "model.path": model,
            "model.max_model_len": max_model_len,
            "model.dtype": dtype,
            "model.seed": seed,
            "cache.kv_cache_memory": kv_cache_memory,
            "parallel.tensor_parallel_size": tensor_parallel_size,
            "parallel.data_parallel_size": data_parallel_size,
        }
        fields.update({key.replace("__", "."): value for key, value in options.items()})
        self.engine = AsyncLLM(build_settings(settings, **fields))
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engine", daemon=True)
        self._thread.start()
        try:
            self._run(self.engine.start(), START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order; `sampling_params` may be one per prompt."""
        batch = _as_prompt_list(prompts)
        return self._run(self._gather([{"prompt": p} for p in batch], sampling_params))

    def chat(
        self,
        conversations: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        batch: Sequence[Conversation]
        if conversations and isinstance(conversations[0], Mapping):
            batch = [conversations]  # type: ignore[list-item]
        else:
            batch = conversations  # type: ignore[assignment]
        return self._run(self._gather([{"messages": list(c)} for c in batch], sampling_params))

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            self._run(self.engine.shutdown(), 120.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._loop.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _gather(
        self,
        requests: list[dict[str, Any]],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            per_request = [params or SamplingParams()] * len(requests)
        else:
            per_request = list(params)
            if len(per_request) != len(requests):
                raise ValueError(
                    f"got {len(per_request)} sampling params for {len(requests)} prompts; "
                    "pass one, or one per prompt"
                )
        runs = (
            self.engine.generate(params=p, **request)
            for request, p in zip(requests, per_request, strict=True)
        )
        return list(await asyncio.gather(*runs))

    def stats(self) -> dict[str, Any]:
        """The engine's figures (scheduler, KV cache, restarts), as the admin socket shows."""
        return self.engine.stats()

    def _run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(token, int) for token in prompts):
        return [list(prompts)]  # type: ignore[arg-type]  # one prompt of token ids
    return [p if isinstance(p, str) else list(p) for p in prompts]  # type: ignore[arg-type]
