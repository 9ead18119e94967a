"""The tokenizer actor: chat template + tokenization, and the first check of a request's size.

Requests come from the gateway; tokenized ones go to the scheduler, and so do refused ones (as
RequestFailed, which travel the request path to the gateway like every failure). The ids made of
a text prompt go straight back to the gateway too (PROMPTS_RING), after the submission: the
gateway learns them from here alone, so they cross no other ring on their way. A request that
breaks tokenization fails alone and the actor keeps serving: status 400 when its input is at
fault (a bad value, a chat template that refuses the messages), 500 for anything else. It never
imports torch (see text/hf_tokenizer).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from engine.actors.configs import TokenizerConfig
from engine.messages.codec import too_large_for_one_frame
from engine.messages.failures import RequestFailed
from engine.messages.requests import GATEWAY_TO_TOKENIZER, GenerateRequest, PromptTokens
from engine.messages.ring_catalogue import PROMPTS_RING, REQUESTS_RING, SUBMIT_RING
from engine.messages.roles import Role
from engine.messages.scheduling import AbortRequests, SubmitRequest
from engine.request.outputs import EngineError
from engine.runtime.actor import Actor
from engine.text.hf_tokenizer import (
    import_transformers_without_torch,
    load_text_encoder,
    load_tokenizer_without_torch,
    remove_text_encoder,
    save_text_encoder,
)
from engine.text.prompt import PromptBuilder
from engine.text.template_bounds import Bounds, TemplateBoundError

# Prompts with more characters than this are tokenized on a thread: a multi-megabyte prompt takes
# seconds, during which the loop must keep beating the heart and serving the other requests.
# Below it, a thread's hand-off costs more than the tokenizing.
INLINE_CHARS = 16_384
# One request's frame for the scheduler, and for the gateway the ids made of its text (None: it
# came as ids, or failed).
# (the frame for the scheduler, if any; the frame of the prompt's ids for the gateway, if any)
Tokenized = tuple[bytes | None, bytes | None]
SAVED_DIR = "/dev/shm"  # where the built tokenizer waits for a restart (see on_start)
SAVE_WAIT_S = 10.0  # a stop waits this long for the first start's save to end


class TokenizerActor(Actor):
    channels = (GATEWAY_TO_TOKENIZER,)
    role = Role.TOKENIZER

    @classmethod
    def preload(cls) -> None:
        """transformers, which a restart's tokenizer would otherwise import while recovering."""
        import_transformers_without_torch()

    async def on_start(self) -> dict[str, Any] | None:
        config = msgspec.msgpack.decode(self.config, type=TokenizerConfig)
        self._config = config
        # Token-id prompts (every resubmission of a request the gateway knows the tokens of)
        # need no tokenizer: this builder serves them while the real one loads.
        self._ids_builder = self._prompt_builder(None)
        self._text_builder: PromptBuilder | None = None  # text prompts, while it loads
        self.builder: PromptBuilder | None = None
        # One thread: big prompts wait for each other, not for the model's cores.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._on_thread: dict[str, int] = {}  # request id -> epoch being tokenized there
        self._tasks: set[asyncio.Task[None]] = set()
        self._max_frame_bytes = self.rings.writer(SUBMIT_RING.name).spec.max_frame_bytes
        # Where this run's tokenizer actors keep the built tokenizer for their successors: the
        # root's run directory (owner-only), so a crashed run's is swept like its segments.
        digest = hashlib.sha256(config.model_path.encode()).hexdigest()[:20]
        self._saved_path = os.path.join(SAVED_DIR, self.run_dir, f"tokenizer-{digest}")
        self._saving: asyncio.Future[bool] | None = None
        loop = asyncio.get_running_loop()
        if self.generation == 0:  # the first start proves the tokenizer loads, or fails the start
            tokenizer = self._load_builder()
            self._saving = loop.run_in_executor(
                None, save_text_encoder, tokenizer, self._saved_path
            )
        else:
            # A restart: text prompts are tokenized by what the predecessor saved, and the
            # transformers tokenizer (seconds: its import and build) loads on the thread, ahead
            # of the chats (and big prompts) queued there behind it.
            try:
                encoder = load_text_encoder(self._saved_path)
            except OSError as exc:  # not a file of ours: refused, the full tokenizer will do
                self.log.warning("%s", exc)
                encoder = None
            if encoder is not None:
                self._text_builder = self._prompt_builder(encoder)
            loading = loop.run_in_executor(self._executor, self._load_builder)
            loading.add_done_callback(self._on_loaded)
        return None

    def _prompt_builder(self, tokenizer: Any) -> PromptBuilder:
        config = self._config
        bounds = None
        if config.template_chars and config.template_cpu_seconds:
            bounds = Bounds(config.template_chars, config.template_cpu_seconds)
        return PromptBuilder(
            tokenizer,
            config.max_model_len,
            config.vocab_size,
            config.allow_special_tokens_in_chat,
            bounds,
        )

    def _load_builder(self) -> Any:
        tokenizer = load_tokenizer_without_torch(self._config.model_path)
        self.builder = self._prompt_builder(tokenizer)
        return tokenizer

    def _on_loaded(self, loading: asyncio.Future[Any]) -> None:
        if loading.cancelled() or loading.exception() is None:
            return
        self.log.error("the tokenizer failed to load: %r", loading.exception())
        self.stop(f"the tokenizer failed to load: {loading.exception()!r}")  # restarted

    async def on_stop(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._saving is not None:  # else it could land after the removal below
            await asyncio.wait((self._saving,), timeout=SAVE_WAIT_S)
        remove_text_encoder(self._saved_path)  # a killed actor leaves it to its successor

    async def handle(self, ring: str, frames: list[bytes]) -> None:
        done: list[Tokenized] = []
        for message in REQUESTS_RING.decode_many(frames):  # its one inbound ring
            if isinstance(message, AbortRequests):
                for request_id in message.request_ids:  # its thread's result will be dropped
                    self._on_thread.pop(request_id, None)
                done.append((SUBMIT_RING.encode(message), None))
            elif (builder := self._inline_builder(message)) is not None:
                done.append(self._tokenize(message, builder))
            else:
                self._tokenize_on_thread(message)
        await self._pass_on(done)

    async def _pass_on(self, done: list[Tokenized]) -> None:
        """Submissions to the scheduler, then the prompts' ids to the gateway: the scheduler's
        work is on each request's path; the gateway needs the ids only by its first output."""
        to_scheduler = [frame for frame, _ in done if frame is not None]
        if to_scheduler:
            await self.send_many(SUBMIT_RING, to_scheduler)
        to_gateway = [prompt for _, prompt in done if prompt is not None]
        if to_gateway:
            await self.send_many(PROMPTS_RING, to_gateway)

    def _inline_builder(self, message: GenerateRequest) -> PromptBuilder | None:
        """The builder to tokenize `message` with on the loop; None: on the thread."""
        if message.request.prompt_token_ids is not None:
            return self._ids_builder
        chat = message.request.chat
        if _prompt_chars(message) > INLINE_CHARS or (chat is not None and chat.template):
            return None  # a client's template too: its bounds allow seconds of rendering
        if self.builder is None and message.request.messages is None:
            return self._text_builder  # None too while there is none: after the load
        return self.builder

    def _tokenize(
        self, message: GenerateRequest, builder: PromptBuilder | None = None
    ) -> Tokenized:
        """The request's frame for the scheduler (its submission, or its failure), and the
        gateway's of the ids made of its text."""
        try:
            builder = builder or self.builder
            if builder is None:
                raise RuntimeError("the tokenizer failed to load")
            token_ids = builder.build(message)
        except Exception as exc:  # fails this request alone
            return SUBMIT_RING.encode(_failure(message, exc)), None
        if message.request.tokenize_only:  # /tokenize: the ids are all it asked for
            prompt = PromptTokens(message.request_id, message.epoch, token_ids)
            return None, PROMPTS_RING.encode(prompt)
        frame = SUBMIT_RING.encode(_submission(message, token_ids))
        if len(frame) > self._max_frame_bytes:
            error = too_large_for_one_frame(len(frame), self._max_frame_bytes)
            return SUBMIT_RING.encode(_failed(message, 400, error)), None
        if message.request.prompt_token_ids is not None:
            return frame, None  # the gateway has them
        prompt = PromptTokens(message.request_id, message.epoch, token_ids)
        return frame, PROMPTS_RING.encode(prompt)

    def _tokenize_on_thread(self, message: GenerateRequest) -> None:
        self._on_thread[message.request_id] = message.epoch
        task = asyncio.get_running_loop().create_task(self._finish_on_thread(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _finish_on_thread(self, message: GenerateRequest) -> None:
        loop = asyncio.get_running_loop()
        try:
            done = await loop.run_in_executor(self._executor, self._tokenize, message)
        finally:
            # Aborted, or resubmitted under a newer epoch, while it was on the thread: its
            # result would run a request nobody waits for.
            current = self._on_thread.get(message.request_id) == message.epoch
            if current:
                del self._on_thread[message.request_id]
        if current:
            await self._pass_on([done])


def _prompt_chars(submitted: GenerateRequest) -> int:
    request = submitted.request
    if request.prompt_token_ids is not None:
        return 0
    if request.messages is not None:
        return sum(len(message.content) for message in request.messages)
    return len(request.prompt or "")


def _submission(submitted: GenerateRequest, token_ids: list[int]) -> SubmitRequest:
    request = submitted.request
    return SubmitRequest(
        request_id=submitted.request_id,
        epoch=submitted.epoch,
        prompt_token_ids=token_ids,
        params=request.params,
        seed=submitted.seed,
        resume=submitted.resume,
        kv_handoff=request.kv_handoff,
        kv_source=request.kv_source,
        tenant=request.tenant,
        priority=request.priority,
        cache_salt=request.cache_salt,
    )


def _failure(request: GenerateRequest, exc: Exception) -> RequestFailed:
    if isinstance(exc, EngineError):
        return _failed(request, exc.status, exc.message, exc.param)
    chat = request.request.chat
    if isinstance(exc, TemplateBoundError) and chat is not None and chat.template:
        return _failed(request, 400, str(exc), "chat_template")  # the client's own template
    if _input_error(exc):
        return _failed(request, 400, str(exc), _param_of(request))
    return _failed(request, 500, f"could not tokenize this request: {type(exc).__name__}: {exc}")


def _failed(
    request: GenerateRequest, status: int, message: str, param: str | None = None
) -> RequestFailed:
    return RequestFailed(
        request_id=request.request_id,
        epoch=request.epoch,
        status=status,
        message=message,
        actor="tokenizer",
        param=param,
    )


def _input_error(exc: Exception) -> bool:
    """Errors that say the input is wrong: bad values, and chat templates that refuse the
    messages (jinja2's errors, raised from the template itself)."""
    if isinstance(exc, ValueError | TypeError | LookupError):
        return True
    return any(cls.__module__.startswith("jinja2") for cls in type(exc).__mro__)


def _param_of(submitted: GenerateRequest) -> str:
    if submitted.request.messages is not None:
        return "messages"
    return "prompt"
