"""LLM: the blocking library API over AsyncLLM (as vLLM's `LLM`).

The actor system runs on an event loop in a background thread of the calling process; `close()`
(or leaving the `with` block) stops every actor and removes every segment.
"""

from __future__ import annotations

import asyncio
import difflib
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import msgspec
import uvloop
from tqdm import tqdm

from engine.launch.hf_cache import with_resolved_model
from engine.library.async_llm import AsyncLLM
from engine.library.embeddings import embed
from engine.messages.admin import EngineStats
from engine.messages.params import LoRARequest, SamplingParams
from engine.messages.requests import EngineRequest
from engine.request.embeddings import pooling_for
from engine.request.outputs import EmbeddingRequestOutput, RequestOutput
from engine.request.prompts import Prompt, library_request
from engine.settings import Settings
from engine.settings.schema import cross_field_problems
from engine.text.hf_tokenizer import load_tokenizer_without_torch

T = TypeVar("T")

Conversation = list[Mapping[str, Any]]

START_TIMEOUT_S = 600.0

# vLLM's engine arguments (LLM(...) keywords) that mean one of our settings.
ENGINE_ARGS = {
    "model": "model.path",
    "served_model_name": "model.served_name",
    "dtype": "model.dtype",
    "device": "model.device",
    "seed": "model.seed",
    "max_model_len": "model.max_model_len",
    "tensor_parallel_size": "parallel.tensor_parallel_size",
    "data_parallel_size": "parallel.data_parallel_size",
    "gpu_memory_utilization": "cache.kv_cache_fraction",
    "kv_cache_memory": "cache.kv_cache_memory",
    "kv_cache_memory_bytes": "cache.kv_cache_memory",
    "block_size": "cache.block_size",
    "enable_prefix_caching": "cache.enable_prefix_caching",
    "max_num_seqs": "scheduler.max_num_seqs",
    "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "generation_config": "model.generation_config",
    "max_logprobs": "model.max_logprobs",
    "kv_cache_dtype": "cache.kv_cache_dtype",
    "quantization": "model.quantization",
    "enable_lora": "lora.enable_lora",
    "max_loras": "lora.max_loras",
    "max_lora_rank": "lora.max_lora_rank",
    "max_cpu_loras": "lora.max_cpu_loras",
}
# vLLM's engine arguments that change nothing here, accepted so that vLLM code runs unchanged.
NO_OP_ENGINE_ARGS = {
    "enforce_eager": "steps always run eagerly",
    "trust_remote_code": "checkpoints run through our own architectures, never remote code",
    "disable_log_stats": "the library logs no periodic stats",
}


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


def engine_settings(settings: Settings | None, engine_args: Mapping[str, Any]) -> Settings:
    """Settings from vLLM-style engine arguments (and ours as `section__field`); a TypeError
    names an unknown argument and the known ones closest to it."""
    fields: dict[str, Any] = {}
    for name, value in engine_args.items():
        if name == "served_model_name" and isinstance(value, str):
            fields[ENGINE_ARGS[name]] = [value]  # vLLM takes one name or a list
        elif name in ENGINE_ARGS:
            fields[ENGINE_ARGS[name]] = value
        elif "__" in name:
            fields[name.replace("__", ".")] = value
        elif name not in NO_OP_ENGINE_ARGS:
            known = [*ENGINE_ARGS, *NO_OP_ENGINE_ARGS]
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise TypeError(f"LLM() got an unknown engine argument {name!r}{hint}")
    return build_settings(settings, **fields)


class LLM:
    def __init__(
        self, model: str | None = None, *, settings: Settings | None = None, **engine_args: Any
    ) -> None:
        """`engine_args`: vLLM's names (tensor_parallel_size, max_model_len, dtype, seed,
        gpu_memory_utilization, max_num_seqs, ..., see ENGINE_ARGS), or any of our settings as
        `section__field=value` (e.g. `cache__block_size=8`)."""
        settings = engine_settings(settings, {"model": model, **engine_args})
        self.engine = AsyncLLM(with_resolved_model(settings))  # a repo id: from the HF cache
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
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order; `sampling_params` may be one per prompt, and
        so may `lora_request` (the LoRA adapter to run with; None: the base model).
        A prompt is text, token ids, {"prompt": text} or {"prompt_token_ids": ids}."""
        batch = _as_prompt_list(prompts)
        loras = _per_prompt(lora_request, len(batch))
        params = _per_request(sampling_params, len(batch))

        def requests() -> list[EngineRequest]:
            together = zip(batch, params, loras, strict=True)
            return [library_request(p, sp, lora_request=lora) for p, sp, lora in together]

        return self._run(self._gather(requests, use_tqdm))

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per conversation, rendered with the model's chat template (or
        `chat_template`, with `chat_template_kwargs`, e.g. {"enable_thinking": False}), with
        the LoRA adapter `lora_request` (None: the base model)."""
        one = bool(messages) and isinstance(messages[0], Mapping)
        batch: Sequence[Conversation] = [messages] if one else messages  # type: ignore[list-item,assignment]
        params = _per_request(sampling_params, len(batch))

        def requests() -> list[EngineRequest]:
            return [
                library_request(
                    None,
                    sp,
                    messages=list(conversation),
                    chat_template=chat_template,
                    chat_template_kwargs=chat_template_kwargs,
                    add_generation_prompt=add_generation_prompt,
                    lora_request=lora_request,
                )
                for conversation, sp in zip(batch, params, strict=True)
            ]

        return self._run(self._gather(requests, use_tqdm))

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling: str | None = None,
        normalize: bool | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in order (vLLM's LLM.embed): the final hidden states of the
        prompt pooled by `pooling`, "last" (the last token's) or "mean"; None: the engine's
        model.pooler_config. `normalize`: to unit length (None: as configured)."""
        chosen = pooling_for(self.engine.policy.pooling, pooling, normalize)
        batch = _as_prompt_list(prompts)

        async def embed_all() -> list[EmbeddingRequestOutput]:
            return list(await asyncio.gather(*(embed(self.engine, p, chosen) for p in batch)))

        return self._run(embed_all())

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's generation_config.json defaults (model.generation_config), as vLLM's."""
        return self.engine.policy.default_params()

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (a transformers tokenizer, loaded without torch)."""
        return load_tokenizer_without_torch(self.engine.model_path)

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
        self, requests: Callable[[], list[EngineRequest]], use_tqdm: bool
    ) -> list[RequestOutput]:
        """Run every request at once; `requests` builds them on the engine's loop, so that a
        refusal of one (EngineError naming the field) is raised as the request's would be."""
        batch = requests()
        with tqdm(total=len(batch), desc="requests", unit="req", disable=not use_tqdm) as bar:

            async def run(request: EngineRequest) -> RequestOutput:
                output = await self.engine.complete_request(request)
                bar.update(1)
                return output

            return list(await asyncio.gather(*(run(request) for request in batch)))

    def stats(self) -> EngineStats:
        """The engine's figures (scheduler, KV cache, restarts), as the admin socket shows."""
        return self.engine.stats()

    def _run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | Mapping):
        return [prompts]
    if prompts and all(isinstance(token, int) for token in prompts):
        return [list(prompts)]  # type: ignore[arg-type]  # one prompt of token ids
    return list(prompts)  # type: ignore[arg-type]


def _per_request(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams | None]:
    """One SamplingParams per request (None: the engine's defaults), or ValueError."""
    if params is None or isinstance(params, SamplingParams):
        return [params] * count
    per_request: list[SamplingParams | None] = list(params)
    if len(per_request) != count:
        raise ValueError(
            f"got {len(per_request)} sampling params for {count} prompts; "
            "pass one, or one per prompt"
        )
    return per_request


def _per_prompt(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    """One adapter per prompt: the one given for all, or the list given (one per prompt)."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise ValueError(f"got {len(loras)} lora requests for {count} prompts; pass one per prompt")
    return loras
