"""The P/D contract between the proxy and instances (vLLM's), as pure functions on bodies.

A prefill instance gets the client's body asking for one token, not streamed, with
`kv_transfer_params: {"do_remote_decode": true}`; its JSON answer carries a top-level
`kv_transfer_params` object (opaque here) when it holds the prompt's KV for a decode instance.
The decode instance gets the client's body unchanged plus that object, and computes the first
token itself. Only `kv_transfer_params` is the proxy's: a client's own is not passed on.
"""

from __future__ import annotations

from typing import Any

import msgspec

FIELD = "kv_transfer_params"
ASK_PREFILL = {"do_remote_decode": True}

_ANY = msgspec.json.Decoder()


def json_object(body: bytes) -> dict[str, Any] | None:
    """The body as a JSON object, or None if it is not one (the instance then says why)."""
    try:
        value = _ANY.decode(body)
    except msgspec.DecodeError:
        return None
    return value if isinstance(value, dict) else None


def prefill_body(request: dict[str, Any]) -> bytes:
    body = dict(request)
    body["stream"] = False
    body.pop("stream_options", None)  # only valid with stream: true
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:  # chat: it takes precedence over max_tokens
        body["max_completion_tokens"] = 1
    body[FIELD] = ASK_PREFILL
    return msgspec.json.encode(body)


def decode_body(request: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> bytes:
    body = dict(request)
    body.pop(FIELD, None)
    if kv_transfer_params is not None:
        body[FIELD] = kv_transfer_params
    return msgspec.json.encode(body)


def kv_transfer_params_of(prefill_answer: bytes) -> dict[str, Any] | None:
    """The answer's transfer parameters; None when absent or null (the prompt was too short to
    hand off, or the instance is colocated). ValueError when they are something else: a decode
    instance would refuse them, so they are not passed on."""
    answer = json_object(prefill_answer)
    params = answer.get(FIELD) if answer is not None else None
    if params is None or isinstance(params, dict):
        return params
    raise ValueError(f"{FIELD} is a JSON {type(params).__name__}, not an object")


def error_body(message: str, status: int, kind: str = "server_error") -> bytes:
    """An OpenAI-style error body for the proxy's own answers (vLLM's proxy: numeric code)."""
    error = {"message": message, "type": kind, "param": None, "code": status}
    return msgspec.json.encode({"error": error})


def stream_error_event(message: str, status: int = 502) -> bytes:
    """What ends a stream whose decode instance failed mid-way: the error as an SSE event (the
    openai client raises it), then the end marker."""
    return b"data: " + error_body(message, status) + b"\n\ndata: [DONE]\n\n"
