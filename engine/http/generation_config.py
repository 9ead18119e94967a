"""The model's generation_config.json defaults applied to an API request: only to the fields the
body did not set (read from the body again: the parsed SamplingParams cannot tell a default
from a value the client sent)."""

from __future__ import annotations

from typing import Any

import msgspec

from engine.http.errors import ApiError
from engine.http.parsing import PreparedRequest
from engine.request.defaults import with_defaults


class _SetFields(msgspec.Struct, kw_only=True):
    temperature: Any = msgspec.UNSET
    top_p: Any = msgspec.UNSET
    top_k: Any = msgspec.UNSET
    min_p: Any = msgspec.UNSET
    repetition_penalty: Any = msgspec.UNSET
    max_tokens: Any = msgspec.UNSET
    max_completion_tokens: Any = msgspec.UNSET


_DECODER = msgspec.json.Decoder(_SetFields)


def apply_generation_defaults(
    prepared: PreparedRequest, body: bytes, defaults: dict[str, Any]
) -> None:
    if not defaults:
        return
    sent = _DECODER.decode(body)  # the body parsed already: it is valid JSON
    explicit = {
        name
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        if getattr(sent, name) not in (msgspec.UNSET, None)
    }
    if sent.max_tokens not in (msgspec.UNSET, None) or sent.max_completion_tokens not in (
        msgspec.UNSET,
        None,
    ):
        explicit.add("max_tokens")
    params = with_defaults(prepared.params, defaults, explicit)
    try:
        params.validate()
    except ValueError as e:
        raise ApiError(400, f"the model's generation_config.json default is invalid: {e}") from None
    prepared.params = params
