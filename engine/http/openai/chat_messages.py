"""A chat request's `messages` → the engine's ChatMessages, checked once, in the API's terms: the
roles accepted (`developer` is `system`), text parts joined, and the tool fields as chat templates
read them. Each bad message is an `ApiError` (400) naming its field. Used by the chat API and
/tokenize."""

from __future__ import annotations

import json
from typing import Any

from engine.http.openai.errors import ApiError
from engine.http.openai.protocol import ChatMessageIn
from engine.messages.requests import ChatMessage

CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")


def chat_messages(messages: list[ChatMessageIn]) -> list[ChatMessage]:
    return [chat_message(f"messages[{i}]", message) for i, message in enumerate(messages)]


def chat_message(where: str, message: ChatMessageIn) -> ChatMessage:
    if message.role not in CHAT_ROLES:
        raise ApiError(
            400,
            f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, got {message.role!r}",
            param=f"{where}.role",
        )
    role = "system" if message.role == "developer" else message.role
    if message.content is None and role not in ("assistant", "tool"):
        raise ApiError(400, f"'{where}.content' is required", param=f"{where}.content")
    return ChatMessage(
        role,
        _text(where, message.content),
        tool_calls=_tool_calls(where, message),
        tool_call_id=message.tool_call_id,
        name=message.name if role == "tool" else None,
    )


def _text(where: str, content: str | list[Any] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise ApiError(
                400,
                f"'{where}.content[{j}]' must be a text part "
                f"({{'type': 'text', 'text': ...}}), got type {part.type!r}",
                param=f"{where}.content[{j}].type",
            )
        texts.append(part.text)
    return "\n".join(texts)


def _tool_calls(where: str, message: ChatMessageIn) -> list[dict[str, Any]] | None:
    """An assistant's earlier calls as chat templates read them: arguments as objects, which
    templates serialize."""
    if not message.tool_calls:
        return None
    calls = []
    for j, call in enumerate(message.tool_calls):
        field = f"{where}.tool_calls[{j}].function.arguments"
        arguments = json_arguments(field, call.function.arguments)
        function = {"name": call.function.name, "arguments": arguments}
        calls.append({"id": call.id, "type": call.type, "function": function})
    return calls


def json_arguments(field: str, arguments: str) -> Any:
    """A tool call's arguments (JSON text, as OpenAI's API carries them) as an object."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        raise ApiError(400, f"'{field}' must be a JSON text", param=field) from None
