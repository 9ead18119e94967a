"""A Responses API request → the chat run it is (an EngineRequest built straight from it): input
items → chat messages (consecutive function calls make one assistant turn), the instructions as
a system message, tools, tool_choice, text.format → a structured-output constraint,
max_output_tokens; each bad item an ApiError naming its field."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.http.openai.chat_messages import json_arguments
from engine.http.openai.errors import ApiError, required
from engine.http.openai.output_controls import one_constraint
from engine.http.openai.parsing import (
    OpenAIRequest,
    chat_api_request,
    check_model,
    given,
    unset_fields,
)
from engine.http.openai.protocol import (
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolIn,
)
from engine.http.openai.responses.protocol import (
    FunctionTool,
    InputItem,
    NamedFunctionChoice,
    ResponsesRequest,
    TextConfig,
)
from engine.http.openai.responses.store import Conversation, ResponseStore
from engine.http.openai.tool_calls import plan_tools, template_kwargs
from engine.messages.params import SamplingParams, StructuredOutputsParams
from engine.messages.requests import ChatMessage, ChatOptions, EngineRequest

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def chat_request(
    req: ResponsesRequest, conversation: Conversation, served_names: Sequence[str]
) -> OpenAIRequest:
    """The chat run a response is: its messages, sampling, tools and text format."""
    model = check_model(req.model, served_names)
    system = [ChatMessage("system", req.instructions)] if req.instructions else []
    messages = [*system, *conversation]
    if not messages:
        raise ApiError(400, "'input' must hold at least one item", param="input")
    tools = [_chat_tool(i, tool) for i, tool in enumerate(req.tools or [])] or None
    choice = None if req.tool_choice is None else _chat_tool_choice(req.tool_choice)
    plan, tool_constraint = plan_tools(tools, choice, req.parallel_tool_calls)
    sources = [(name, c) for name, c in _text_format(req.text) if c is not None]
    if tool_constraint is not None:
        sources.append(("tool_choice", tool_constraint))
    constraint, field_names = one_constraint(sources)
    sampling = {name: getattr(req, name) for name in _SAMPLING}
    params = SamplingParams(
        **given(sampling),
        max_tokens=req.max_output_tokens,
        seed=req.seed,
        structured_outputs=constraint,
    )
    request = EngineRequest(
        params=params,
        messages=messages,
        chat=ChatOptions(template_kwargs=template_kwargs(tools)),
        defaulted_fields=unset_fields({**sampling, "max_tokens": req.max_output_tokens}),
        field_names={**field_names, "max_tokens": "max_output_tokens"},
    )
    return chat_api_request(request, model, stream=req.stream, tool_plan=plan)


def history(req: ResponsesRequest, store: ResponseStore) -> Conversation:
    if req.previous_response_id is None:
        return []
    conversation = store.get(req.previous_response_id)
    if conversation is None:
        raise ApiError(
            404,
            f"previous response with id {req.previous_response_id!r} not found (unknown, not "
            "stored, or dropped from the server's store of finished responses)",
            param="previous_response_id",
            code="not_found",
        )
    return conversation


def input_messages(items: str | list[InputItem]) -> Conversation:
    """`input` as chat messages: consecutive function_call items make one assistant message."""
    if isinstance(items, str):
        return [ChatMessage("user", items)]
    messages: list[ChatMessage] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if item.type == "message":
            messages.append(ChatMessage(_role(where, item), _text(where, item.content)))
        elif item.type == "function_call":
            call = {
                "id": required(where, "call_id", item.call_id),
                "type": "function",
                "function": {
                    "name": required(where, "name", item.name),
                    "arguments": json_arguments(
                        f"{where}.arguments", required(where, "arguments", item.arguments)
                    ),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and last.tool_calls is not None:
                last.tool_calls.append(call)
            else:
                messages.append(ChatMessage("assistant", "", tool_calls=[call]))
        elif item.type == "function_call_output":
            call_id = required(where, "call_id", item.call_id)
            output = required(where, "output", item.output)
            messages.append(ChatMessage("tool", output, tool_call_id=call_id))
        else:
            raise ApiError(
                400,
                f"'{where}.type' must be message, function_call or function_call_output, "
                f"got {item.type!r}",
                param=f"{where}.type",
            )
    return messages


def _role(where: str, item: InputItem) -> str:
    if item.role not in _ROLES:
        raise ApiError(
            400,
            f"'{where}.role' must be one of {', '.join(_ROLES)}, got {item.role!r}",
            param=f"{where}.role",
        )
    return "system" if item.role == "developer" else item.role


def _text(where: str, content: str | list[Any] | None) -> str:
    if content is None:
        raise ApiError(400, f"'{where}.content' is required", param=f"{where}.content")
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise ApiError(
                400,
                f"'{where}.content[{j}]' must be a text part ({{'type': 'input_text', "
                f"'text': ...}}), got type {part.type!r}",
                param=f"{where}.content[{j}].type",
            )
        texts.append(part.text)
    return "\n".join(texts)


def _chat_tool(index: int, tool: FunctionTool) -> ToolIn:
    where = f"tools[{index}]"
    if tool.type != "function":
        raise ApiError(
            400,
            f"'{where}.type' must be 'function' (this server has no built-in tools), "
            f"got {tool.type!r}",
            param=f"{where}.type",
        )
    function = FunctionDefinition(
        name=required(where, "name", tool.name),
        description=tool.description,
        parameters=tool.parameters,
    )
    return ToolIn(function=function)


def _chat_tool_choice(choice: str | NamedFunctionChoice) -> str | NamedToolChoice:
    if isinstance(choice, str):
        return choice
    if choice.type != "function" or choice.name is None:
        raise ApiError(
            400,
            "'tool_choice' must be none, auto, required or {'type': 'function', 'name': ...}",
            param="tool_choice",
        )
    return NamedToolChoice(function=NamedFunction(name=choice.name))


def _text_format(text: TextConfig | None) -> list[tuple[str, StructuredOutputsParams | None]]:
    """The constraint `text.format` asks for, by the field that names it."""
    fmt = None if text is None else text.format
    if fmt is None or fmt.type == "text":
        return []
    if fmt.type == "json_object":
        return [("text.format", StructuredOutputsParams(json_object=True))]
    if fmt.type == "json_schema":
        if fmt.schema is None:
            raise ApiError(
                400,
                "'text.format.schema' is required with type 'json_schema'",
                param="text.format.schema",
            )
        return [("text.format.schema", StructuredOutputsParams(json=fmt.schema))]
    raise ApiError(
        400,
        f"'text.format.type' must be text, json_object or json_schema, got {fmt.type!r}",
        param="text.format.type",
    )
