"""Request fields that constrain the output → SamplingParams' structured_outputs, logit_bias,
allowed_token_ids and bad_words; and the fields this server does not implement, refused.

Only the API's forms are checked here (one constraint at most, logit_bias keys); what a
constraint may be is the engine's rule (engine/request/), whose refusal names the API's field
(`response_format.json_schema.schema`, `guided_json`, ...).
"""

from __future__ import annotations

from typing import Any

from engine.http.openai.errors import ApiError
from engine.http.openai.protocol import (
    UNIMPLEMENTED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
)
from engine.messages.params import StructuredOutputsParams

Request = CompletionRequest | ChatCompletionRequest


def output_controls(
    req: Request, tool_constraint: StructuredOutputsParams | None = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """SamplingParams fields for the request's output controls, and the API's name of each
    (the engine's refusal of a bad constraint names the field the client used).
    `tool_constraint`: what tool_choice required / a named function asks for."""
    sources = _constraints(req)
    if tool_constraint is not None:
        sources.append(("tool_choice", tool_constraint))
    constraint, field_names = one_constraint(sources)
    controls: dict[str, Any] = {}
    if constraint is not None:
        controls["structured_outputs"] = constraint
    if req.logit_bias:
        controls["logit_bias"] = _logit_bias(req.logit_bias)
    if req.allowed_token_ids is not None:
        controls["allowed_token_ids"] = list(req.allowed_token_ids)
    if req.bad_words:
        controls["bad_words"] = list(req.bad_words)
    return controls, field_names


def one_constraint(
    sources: list[tuple[str, StructuredOutputsParams]],
) -> tuple[StructuredOutputsParams | None, dict[str, str]]:
    """The one output constraint of a request's fields (API name, constraint), and the API's
    name for it (the engine's refusal of a bad constraint names it); ApiError for several."""
    if len(sources) > 1:
        names = ", ".join(name for name, _ in sources)
        raise ApiError(
            400, f"at most one output constraint may be given, got {names}", param=sources[1][0]
        )
    if not sources:
        return None, {}
    field, constraint = sources[0]
    return constraint, {"structured_outputs": field}


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
    """The JSON object's keys (strings) as token ids; the values' range is the engine's rule."""
    bias: dict[int, float] = {}
    for key, value in raw.items():
        try:
            token_id = int(key)
        except ValueError:
            raise ApiError(
                400,
                f"logit_bias keys must be token ids (integers >= 0), got {key!r}",
                param="logit_bias",
            ) from None
        bias[token_id] = value
    return bias


# ---- fields this server does not implement -----------------------------------------------------

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


def refuse_unimplemented(req: Request) -> None:
    """400 naming the first field set that would change the output and is not implemented
    (protocol._UnimplementedFields); other unknown fields are accepted, as OpenAI clients send
    fields a server may not know."""
    for name in UNIMPLEMENTED_FIELDS:
        value = getattr(req, name)
        if value is not None and value not in _NEUTRAL.get(name, ()):
            raise ApiError(400, f"'{name}' is not supported by this server", param=name)
