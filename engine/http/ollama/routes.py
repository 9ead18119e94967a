"""Ollama's API beside the OpenAI one, so that tools written for Ollama work unchanged:
/api/generate, /api/chat (generate.py), /api/embed and the older /api/embeddings, /api/tags (the
catalogue), /api/ps (the loaded models), /api/show, /api/version. Errors are Ollama's
`{"error": message}` with the HTTP status Ollama uses (404 for a model it does not have).

An empty prompt (/api/generate) or no messages (/api/chat) loads the model and answers at once
(`done_reason` "load"); with `keep_alive` 0 it unloads it ("unload"), as Ollama does.
"""

from __future__ import annotations

import hashlib
import math
import time
from datetime import UTC, datetime
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine.catalogue.pool import Slot
from engine.http.guards import until_disconnect
from engine.http.ollama.generate import now_text, ollama_error, run
from engine.http.ollama.protocol import (
    ChatBody,
    EmbedBody,
    EmbeddingsBody,
    GenerateBody,
    ModelDetails,
    RunningModel,
    ShowBody,
    TagModel,
)
from engine.http.openai.embeddings import embed_all
from engine.http.openai.errors import ApiError
from engine.http.served import ServedModel, request_keep_alive
from engine.http.state import ServerState
from engine.request.outputs import EngineError

JSON = "application/json"
OLLAMA_VERSION = "0.12.0"  # the API version whose shapes this server follows
B = TypeVar("B")


def ollama_routes(state: ServerState) -> list[Route]:
    async def generate(request: Request) -> Response:
        return await _generation(request, state, GenerateBody)

    async def chat(request: Request) -> Response:
        return await _generation(request, state, ChatBody)

    async def embed(request: Request) -> Response:
        return await _guarded(_embed(request, state))

    async def embeddings(request: Request) -> Response:
        return await _guarded(_embeddings(request, state))

    async def tags(request: Request) -> Response:
        state.authorize(request)
        models = [_tag(slot) for slot in state.models.slots.values()]
        return _json({"models": models})

    async def ps(request: Request) -> Response:
        state.authorize(request)
        loaded = [s for s in state.models.slots.values() if s.state == "loaded"]
        return _json({"models": [_running(state, slot) for slot in loaded]})

    async def show(request: Request) -> Response:
        return await _guarded(_show(request, state))

    async def version(request: Request) -> Response:
        return _json({"version": OLLAMA_VERSION})

    return [
        Route("/api/generate", generate, methods=["POST"]),
        Route("/api/chat", chat, methods=["POST"]),
        Route("/api/embed", embed, methods=["POST"]),
        Route("/api/embeddings", embeddings, methods=["POST"]),
        Route("/api/tags", tags, methods=["GET"]),
        Route("/api/ps", ps, methods=["GET"]),
        Route("/api/show", show, methods=["POST"]),
        Route("/api/version", version, methods=["GET"]),
    ]


async def _guarded(work: Any) -> Response:
    """An ApiError or EngineError in Ollama's error shape."""
    try:
        return await work  # type: ignore[no-any-return]
    except (ApiError, EngineError) as e:
        return ollama_error(e.status, e.message)


async def _body(request: Request, state: ServerState, kind: type[B]) -> B:
    state.authorize(request)
    return await _decoded(request, state, kind)


async def _decoded(request: Request, state: ServerState, kind: type[B]) -> B:
    body = await state.read_body(request)
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"invalid request body: {e}") from None
    except msgspec.DecodeError:
        raise ApiError(400, "the request body is not valid JSON") from None


def _model_of(state: ServerState, name: str) -> str:
    if not name:
        raise ApiError(400, "model is required")
    if name not in state.served_names:
        raise ApiError(404, f"model '{name}' not found")
    return name


def _keep_alive(value: Any) -> float | None:
    try:
        return request_keep_alive(value)
    except ValueError as e:
        raise ApiError(400, str(e)) from None


async def _generation(
    request: Request, state: ServerState, kind: type[ChatBody | GenerateBody]
) -> Response:
    arrival = time.monotonic()
    try:
        if state.draining:
            raise ApiError(503, "the server is shutting down")
        tenant = state.authorize(request)
        body = await _decoded(request, state, kind)
        model = _model_of(state, body.model)
        keep_alive = _keep_alive(body.keep_alive)
        empty = not body.messages if isinstance(body, ChatBody) else not body.prompt
        if empty:
            return await _load_or_unload(state, model, keep_alive, isinstance(body, ChatBody))
        lease = await until_disconnect(request, state.acquire(model, keep_alive))
    except (ApiError, EngineError) as e:
        return ollama_error(e.status, e.message)
    if lease is None:
        return Response(status_code=499)  # the client left while its model loaded
    load_seconds = time.monotonic() - arrival if lease is not None else 0.0
    try:
        return await run(state, lease, body, model, (load_seconds, arrival), tenant)
    except ApiError as e:  # the body's own fault, found while building the request
        lease.release()
        return ollama_error(e.status, e.message)


async def _load_or_unload(
    state: ServerState, model: str, keep_alive: float | None, chat: bool
) -> Response:
    name = state.base_of(model)
    if keep_alive == 0:
        await state.models.unload(name)
        reason = "unload"
    else:
        await state.models.load(name, keep_alive)
        reason = "load"
    body: dict[str, Any] = {"model": model, "created_at": now_text()}
    if chat:
        body["message"] = {"role": "assistant", "content": ""}
    else:
        body["response"] = ""
    return _json(body | {"done": True, "done_reason": reason})


async def _embed(request: Request, state: ServerState) -> Response:
    began = time.monotonic()
    body = await _body(request, state, EmbedBody)
    model = _model_of(state, body.model)
    inputs = [body.input] if isinstance(body.input, str) else list(body.input)
    if not inputs or not all(inputs):
        raise ApiError(400, "'input' must be a non-empty string or list of strings")
    outputs = await embed_all(state, model, inputs, None, _keep_alive(body.keep_alive))
    vectors = [output.outputs.embedding for output in outputs]
    if body.dimensions is not None and body.dimensions != len(vectors[0]):
        raise ApiError(400, f"'dimensions' must be the model's embedding size {len(vectors[0])}")
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    state.metrics.for_model(state.base_of(model)).count_request("ollama_embed", "success")
    return _json(
        {
            "model": model,
            "embeddings": vectors,
            "total_duration": int((time.monotonic() - began) * 1e9),
            "prompt_eval_count": prompt_tokens,
        }
    )


async def _embeddings(request: Request, state: ServerState) -> Response:
    body = await _body(request, state, EmbeddingsBody)
    model = _model_of(state, body.model)
    if not body.prompt:
        return _json({"embedding": []})  # as Ollama answers an empty prompt
    (output,) = await embed_all(state, model, [body.prompt], False, _keep_alive(body.keep_alive))
    return _json({"embedding": output.outputs.embedding})


async def _show(request: Request, state: ServerState) -> Response:
    body = await _body(request, state, ShowBody)
    model = _model_of(state, body.model or body.name)
    slot = state.models.slots[state.base_of(model)]
    lease = await state.acquire(model)  # its template and context are read from the model
    try:
        served = lease.engine
        template = served.llm.policy.chat_template or ""
        info = {
            "general.architecture": served.llm.model_name,
            "context_length": served.max_model_len,
        }
        return _json(
            {
                "modelfile": f"FROM {slot.entry.path}\n",
                "parameters": "",
                "template": template,
                "details": msgspec.to_builtins(_details(slot)),
                "model_info": info,
                "capabilities": ["completion"],
                "modified_at": _modified(slot),
            }
        )
    finally:
        lease.release()


def _tag(slot: Slot[ServedModel]) -> TagModel:
    return TagModel(
        name=slot.name,
        model=slot.name,
        modified_at=_modified(slot),
        size=_size(slot),
        digest=_digest(slot),
        details=_details(slot),
    )


def _running(state: ServerState, slot: Slot[ServedModel]) -> RunningModel:
    keep = state.models.keep_alive_of(slot)
    expires = slot.expires_at
    if slot.in_flight or expires is None:
        remaining = math.inf if math.isinf(keep) else keep
    else:
        remaining = max(0.0, expires - time.monotonic())
    # Ollama shows a model kept forever as expiring far in the future.
    until = time.time() + (remaining if math.isfinite(remaining) else 10 * 365 * 86400)
    served = slot.engine
    return RunningModel(
        name=slot.name,
        model=slot.name,
        size=slot.memory,
        digest=_digest(slot),
        details=_details(slot),
        expires_at=datetime.fromtimestamp(until, UTC).isoformat().replace("+00:00", "Z"),
        context_length=served.max_model_len if served is not None else 0,
    )


def _details(slot: Slot[ServedModel]) -> ModelDetails:
    path = slot.entry.path
    gguf = path.endswith(".gguf")
    return ModelDetails(format="gguf" if gguf else "safetensors")


def _size(slot: Slot[ServedModel]) -> int:
    from pathlib import Path

    path = Path(slot.entry.path)
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return 0


def _modified(slot: Slot[ServedModel]) -> str:
    from pathlib import Path

    path = Path(slot.entry.path)
    stamp = path.stat().st_mtime if path.exists() else time.time()
    return datetime.fromtimestamp(stamp, UTC).isoformat().replace("+00:00", "Z")


def _digest(slot: Slot[ServedModel]) -> str:
    return hashlib.sha256(slot.entry.path.encode()).hexdigest()


def _json(body: Any) -> Response:
    return Response(msgspec.json.encode(body), media_type=JSON)
