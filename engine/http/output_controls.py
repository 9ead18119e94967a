"""Request fields that constrain the output → SamplingParams' structured_outputs, logit_bias,
allowed_token_ids and bad_words; and the fields this server does not implement, refused.

Every constraint is checked here, before any compute, with the API's own field name in the
error (`response_format.json_schema.schema`, `structured_outputs.regex`, `guided_json`, ...).
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from engine.http.errors import ApiError
from engine.http.protocol import ChatCompletionRequest, CompletionRequest
from engine.messages.params import MAX_LOGIT_BIAS, StructuredOutputsParams
from engine.structured.spec import check_structured_outputs

log = logging.getLogger(__name__)

Request = CompletionRequest | ChatCompletionRequest


def output_controls(
    req: Request, tool_constraint: StructuredOutputsParams | None = None
) -> dict[str, Any]:
    """SamplingParams fields for the request's output controls (checked; ApiError naming the
    field). `tool_constraint`: what tool_choice required / a named function asks for."""
    sources = _constraints(req)
    if tool_constraint is not None:
        sources.append(("tool_choice", tool_constraint))
    if len(sources) > 1:
        names = ", ".join(name for name, _ in sources)
        raise ApiError(
            400, f"at most one output constraint may be given, got {names}", param=sources[1][0]
        )
    controls: dict[str, Any] = {}
    if sources:
        field, spec = sources[0]
        try:
            check_structured_outputs(spec)
        except ValueError as exc:
            message = str(exc)
            if field != "structured_outputs":
                message = message.replace("structured_outputs", field, 1)
            raise ApiError(400, message, param=field) from None
        controls["structured_outputs"] = spec
    if req.logit_bias:
        controls["logit_bias"] = _logit_bias(req.logit_bias)
    if req.allowed_token_ids is not None:
        controls["allowed_token_ids"] = list(req.allowed_token_ids)
    if req.bad_words:
        controls["bad_words"] = list(req.bad_words)
    return controls


def _constraints(req: Request) -> list[tuple[str, StructuredOutputsParams]]:
    found: list[tuple[str, StructuredOutputsParams]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif fmt.type == "json_schema":
            schema = fmt.json_schema.schema if fmt.json_schema is not None else None
            if schema is None:
                raise ApiError(
                    400,
                    "response_format.json_schema.schema is required with type 'json_schema'",
                    param="response_format.json_schema.schema",
                )
            found.append(("response_format.json_schema.schema", _json(schema)))
        else:
            raise ApiError(
                400,
                "response_format.type must be one of text, json_object, json_schema, got "
                f"{fmt.type!r}",
                param="response_format.type",
            )
    if req.structured_outputs is not None:
        found.append(("structured_outputs", req.structured_outputs))
    older = {
        "guided_json": StructuredOutputsParams(json=req.guided_json),
        "guided_regex": StructuredOutputsParams(regex=req.guided_regex),
        "guided_choice": StructuredOutputsParams(choice=req.guided_choice),
        "guided_grammar": StructuredOutputsParams(grammar=req.guided_grammar),
    }
    for name, spec in older.items():
        if getattr(req, name) is not None:
            found.append((name, spec))
    return found


def _json(schema: dict[str, Any]) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema)


def _logit_bias(raw: dict[str, float]) -> dict[int, float]:
    bias: dict[int, float] = {}
    for key, value in raw.items():
        try:
            token_id = int(key)
        except ValueError:
            token_id = -1
        if token_id < 0:
            raise ApiError(
                400, f"logit_bias keys must be token ids (integers >= 0), got {key!r}",
                param="logit_bias",
            )  # fmt: skip
        # One rule with the library's (SamplingParams.validate): a value outside OpenAI's range
        # is refused, naming the field, rather than changed behind the client's back.
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ApiError(
                400,
                f"logit_bias must be values in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                f"got {value!r}",
                param="logit_bias",
            )
        bias[token_id] = value
    return bias


# ---- fields this server does not implement -----------------------------------------------------


class _Unimplemented(msgspec.Struct, kw_only=True):
    """Fields of OpenAI's or vLLM's API that change the output and that this server does not
    implement: a request setting one (to anything but its neutral value) is refused, never
    silently served as if it had not asked."""

    suffix: Any = None
    best_of: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    chat_template: Any = None
    continue_final_message: Any = None
    add_generation_prompt: Any = None
    documents: Any = None
    logits_processors: Any = None
    truncate_prompt_tokens: Any = None
    guided_whitespace_pattern: Any = None
    mm_processor_kwargs: Any = None
    verbosity: Any = None
    spaces_between_special_tokens: Any = None
    return_tokens_as_token_ids: Any = None
    vllm_xargs: Any = None


_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "suffix": ("",),
    "best_of": (1,),
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "modalities": (["text"],),
    "continue_final_message": (False,),
    "add_generation_prompt": (True,),
    "documents": ([],),
    "logits_processors": ([],),
    "spaces_between_special_tokens": (True,),
    "return_tokens_as_token_ids": (False,),
}
_UNIMPLEMENTED_DECODER = msgspec.json.Decoder(_Unimplemented)
_KNOWN_FIELDS = frozenset(
    CompletionRequest.__struct_fields__
    + ChatCompletionRequest.__struct_fields__
    + _Unimplemented.__struct_fields__
    # handled elsewhere (the API's own fields: echo, prompt_logprobs, ids, stream options)
    + ("echo", "prompt_logprobs", "return_token_ids", "request_id", "user", "stream_options")
)


def refuse_unimplemented(body: bytes) -> None:
    """400 naming the first field set that would change the output and is not implemented;
    other unknown fields are accepted (OpenAI clients send fields a server may not know) and
    logged at debug level."""
    found = _UNIMPLEMENTED_DECODER.decode(body)  # the body already decoded once: valid JSON
    for name in _Unimplemented.__struct_fields__:
        value = getattr(found, name)
        if value is not None and value not in _NEUTRAL.get(name, ()):
            raise ApiError(400, f"'{name}' is not supported by this server", param=name)
    if log.isEnabledFor(logging.DEBUG):
        fields = msgspec.json.decode(body)
        if isinstance(fields, dict):
            unknown = sorted(set(fields) - _KNOWN_FIELDS)
            if unknown:
                log.debug("request fields ignored (unknown to this server): %s", unknown)
