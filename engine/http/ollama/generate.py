"""/api/generate and /api/chat: one Ollama request run on its model, answered as NDJSON lines
(streaming, Ollama's default) or one JSON object.

The request names its model; the model is leased from the pool (loaded first if need be: its
load time is the answer's `load_duration`) with the request's keep_alive, and released when the
answer ends. The chat template renders the messages (and /api/generate's prompt, as a user turn
after its `system`, unless `raw`); sampling options go through the engine's one request policy,
so a refusal is the same as the OpenAI API's, in Ollama's shape ({"error": ...}). A refusal
arrives before the first line; a failure after it is a last line holding "error".
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec
from starlette.responses import Response

from engine.http.ollama.options import sampling_of
from engine.http.ollama.protocol import (
    ChatBody,
    ChatChunk,
    GenerateBody,
    MessageOut,
    OllamaMessage,
    Timings,
    ToolCallOut,
)
from engine.http.openai.chat_output import ChatAnswer
from engine.http.openai.errors import ApiError
from engine.http.openai.tool_calls import ToolPlan
from engine.http.served import ModelLease
from engine.http.state import ServerState
from engine.http.streams import ReleasingStream
from engine.request.outputs import EngineError, RequestOutput
from engine.request.prompts import library_request
from engine.tenants.access import run_as, scoped_id
from engine.tenants.quotas import QuotaLease
from engine.tenants.table import EVERYONE, Tenant

NDJSON = "application/x-ndjson"
_FINISH = {"stop": "stop", "length": "length", "abort": "stop"}


def ollama_error(status: int, message: str, retry_after: int | None = None) -> Response:
    headers = None if retry_after is None else {"Retry-After": str(retry_after)}
    body = msgspec.json.encode({"error": message})
    return Response(body, status, headers=headers, media_type="application/json")


def now_text() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


@dataclass
class OllamaRun:
    """One /api/generate or /api/chat request on its leased model."""

    state: ServerState
    lease: ModelLease
    model: str  # as the request named it (the answer shows it)
    chat: bool
    stream: bool
    answer: ChatAnswer
    arrival: float
    load_seconds: float
    outputs: AsyncIterator[RequestOutput] | None = None
    text: str = ""
    prompt_tokens: int = 0
    tokens: int = 0
    first_token_at: float | None = None
    finish_reason: str | None = None
    sent: list[str] = field(default_factory=list)
    tenant: Tenant = EVERYONE
    quota: QuotaLease | None = None  # its place in its tenant's quotas, settled at its end

    async def open(
        self,
        prompt: str | None,
        messages: list[Mapping[str, Any]] | None,
        template_kwargs: dict[str, Any],
        options: Mapping[str, Any] | None,
        fmt: Any,
    ) -> RequestOutput:
        """Submit the request; its first output (a refusal raises EngineError)."""
        served = self.lease.engine
        sampling = sampling_of(options, served.max_model_len, fmt)
        request = library_request(
            prompt,
            sampling.params,
            messages=messages,
            chat_template_kwargs=template_kwargs or None,
            lora_request=served.adapter_of(self.model),
        )
        # Ollama's names in refusals; the options it left unset take the model's defaults
        request.defaulted_fields = sampling.defaulted
        request.field_names = sampling.field_names
        run_as(self.tenant, [request], self.model, None, None)
        if self.tenant is not EVERYONE:  # in its tenant's namespace, as the OpenAI API's
            request.request_id = scoped_id(self.tenant, "ollama-" + secrets.token_hex(12))
        quotas = self.state.tenants.quotas
        self.quota = quotas.admit(self.tenant.name, sampling.params.max_tokens or 0)
        stream = served.llm.submit(request)
        self.outputs = aiter(stream)
        return await anext(self.outputs)

    def absorb(self, output: RequestOutput) -> None:
        if output.prompt_token_ids:
            self.prompt_tokens = len(output.prompt_token_ids)
        for delta in output.outputs:
            if delta.token_ids and self.first_token_at is None:
                self.first_token_at = time.monotonic()
            self.tokens += len(delta.token_ids)
            self.text += delta.text
            if delta.finish_reason is not None:
                self.finish_reason = delta.finish_reason

    async def rest(self, first: RequestOutput) -> AsyncIterator[RequestOutput]:
        yield first
        assert self.outputs is not None
        if not first.finished:
            async for output in self.outputs:
                yield output

    def chunk(self, finished: bool) -> bytes | None:
        """The line for what the answer has grown by (the last one with the timings); None:
        nothing to send yet."""
        delta, _ = self.answer.delta(self.text, finished)
        if delta is None and not finished:
            return None
        content = delta.content or "" if delta is not None else ""
        thinking = delta.reasoning_content if delta is not None else None
        calls = None
        if finished:
            _, _, found = self.answer.final(self.text)
            calls = [_tool_call(call.name, call.arguments) for call in found] or None
        return self._line(content, thinking, calls, finished)

    def whole(self) -> bytes:
        content, thinking, found = self.answer.final(self.text)
        calls = [_tool_call(call.name, call.arguments) for call in found] or None
        return self._line(content or "", thinking, calls, True)

    def _line(
        self, content: str, thinking: str | None, calls: list[ToolCallOut] | None, finished: bool
    ) -> bytes:
        timings = msgspec.structs.asdict(self.timings()) if finished else {}
        reason = _FINISH.get(self.finish_reason or "stop", "stop") if finished else None
        if self.chat:
            message = MessageOut(
                role="assistant", content=content, thinking=thinking, tool_calls=calls
            )
            body: Any = ChatChunk(
                model=self.model,
                created_at=now_text(),
                message=message,
                done=finished,
                done_reason=reason,
                **timings,
            )
        else:
            body = {"model": self.model, "created_at": now_text(), "response": content}
            if thinking:
                body["thinking"] = thinking
            body["done"] = finished
            if finished:
                body |= {"done_reason": reason, **timings}
        return msgspec.json.encode(body) + b"\n"

    def timings(self) -> Timings:
        now = time.monotonic()
        first = self.first_token_at or now
        return Timings(
            total_duration=_ns(now - self.arrival),
            load_duration=_ns(self.load_seconds),
            prompt_eval_count=self.prompt_tokens,
            prompt_eval_duration=_ns(first - self.arrival - self.load_seconds),
            eval_count=self.tokens,
            eval_duration=_ns(now - first),
        )

    def settle(self) -> None:
        """Charge its tenant what it cost (once; tokens never generated are given back)."""
        if self.quota is not None:
            self.quota.settle(self.prompt_tokens + self.tokens)

    def count(self, outcome: str) -> None:
        self.settle()
        metrics = self.state.metrics.for_model(self.lease.name)
        metrics.count_request("ollama_chat" if self.chat else "ollama_generate", outcome)
        metrics.add_prompt_tokens(self.prompt_tokens)
        metrics.add_generation_tokens(self.tokens)


async def run(
    state: ServerState,
    lease: ModelLease,
    body: ChatBody | GenerateBody,
    model: str,
    timing: tuple[float, float],
    tenant: Tenant = EVERYONE,
) -> Response:
    """Run the request on its leased model, as its tenant; the lease is released when the
    answer ends. `timing`: the seconds its model took to load, and when it arrived."""
    load_seconds, arrival = timing
    chat = isinstance(body, ChatBody)
    thinking = body.think is not None and body.think is not False
    parser = state.settings.server.reasoning_parser
    tools = body.tools if isinstance(body, ChatBody) else None
    plan = _tool_plan(tools, state.settings.server.tool_call_parser)
    answer = ChatAnswer(plan, reasoning=thinking or (body.think is None and parser is not None))
    run_ = OllamaRun(state, lease, model, chat, body.stream, answer, arrival, load_seconds)
    run_.tenant = tenant
    prompt, messages, kwargs = _prompt(body)
    try:
        first = await run_.open(prompt, messages, kwargs, body.options, body.format)
    except EngineError as e:
        lease.release()
        run_.count("error")
        return ollama_error(e.status, e.message, e.retry_after or None)
    except BaseException:
        lease.release()
        raise
    if not body.stream:
        return await _collected(run_, first)
    return ReleasingStream(_lines(run_, first), _releaser(run_), media_type=NDJSON)


async def _collected(run_: OllamaRun, first: RequestOutput) -> Response:
    try:
        async for output in run_.rest(first):
            run_.absorb(output)
    except EngineError as e:
        run_.count("error")
        return ollama_error(e.status, e.message)
    finally:
        run_.lease.release()
    run_.count("success")
    return Response(run_.whole(), media_type="application/json")


async def _lines(run_: OllamaRun, first: RequestOutput) -> AsyncGenerator[bytes, None]:
    try:
        async for output in run_.rest(first):
            run_.absorb(output)
            line = None if output.finished else run_.chunk(False)
            if line is not None:
                yield line
        yield run_.chunk(True) or b""
        run_.count("success")
    except EngineError as e:
        run_.count("error")
        yield msgspec.json.encode({"error": e.message}) + b"\n"


def _releaser(run_: OllamaRun) -> Any:
    async def release() -> None:
        if run_.outputs is not None:
            aclose = getattr(run_.outputs, "aclose", None)
            if aclose is not None:
                await aclose()  # an unfinished request is aborted
        run_.lease.release()
        run_.settle()

    return release


def _prompt(
    body: ChatBody | GenerateBody,
) -> tuple[str | None, list[Mapping[str, Any]] | None, dict[str, Any]]:
    """(prompt text, chat messages, template variables) of the request."""
    kwargs: dict[str, Any] = {}
    if body.think is not None:
        kwargs["enable_thinking"] = body.think is not False
    if isinstance(body, ChatBody):
        if body.tools:
            kwargs["tools"] = body.tools
        return None, [_message(i, m) for i, m in enumerate(body.messages or [])], kwargs
    _refuse_unsupported(body)
    if body.raw:
        return body.prompt or "", None, kwargs
    messages: list[Mapping[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": body.system})
    messages.append({"role": "user", "content": body.prompt or ""})
    return None, messages, kwargs


def _refuse_unsupported(body: GenerateBody) -> None:
    for name, given in (
        ("template", body.template),
        ("suffix", body.suffix),
        ("context", body.context),
        ("images", body.images),
    ):
        if given:
            raise ApiError(400, f"'{name}' is not supported by this server", param=name)


def _message(index: int, message: OllamaMessage) -> dict[str, Any]:
    where = f"messages[{index}]"
    if message.role not in ("system", "user", "assistant", "tool"):
        raise ApiError(400, f"'{where}.role' must be system, user, assistant or tool")
    if message.images:
        raise ApiError(400, f"'{where}.images': this server serves text models only")
    out: dict[str, Any] = {"role": message.role, "content": message.content or ""}
    if message.tool_calls:
        out["tool_calls"] = [{"type": "function", **call} for call in message.tool_calls]
    if message.tool_name:
        out["name"] = message.tool_name
    return out


def _tool_plan(tools: list[dict[str, Any]] | None, parser: str | None) -> ToolPlan | None:
    if not tools:
        return None
    names = [str(tool.get("function", {}).get("name", "")) for tool in tools]
    return ToolPlan("auto", names, parser or "hermes")  # hermes: Qwen's, Ollama's default reader


def _tool_call(name: str, arguments: str) -> ToolCallOut:
    try:
        parsed = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        parsed = arguments
    return ToolCallOut(function={"name": name, "arguments": parsed})


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))
