"""Finished Responses API responses, kept for `previous_response_id` and for
GET /v1/responses/{id}: each one's conversation (its input messages and its answer, as chat
messages) and the Response object itself, in memory, the least recently used dropped past
`capacity` (server.responses_store_size); DELETE /v1/responses/{id} drops one."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple

from engine.messages.requests import ChatMessage

Conversation = list[ChatMessage]


class Stored(NamedTuple):
    conversation: Conversation
    response: dict[str, Any]  # the Response object as the client got it


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._stored: OrderedDict[str, Stored] = OrderedDict()
        self._scope = ""  # the tenant whose responses these are (scoped)

    def scoped(self, tenant: str) -> ResponseStore:
        """The same store (one capacity for all) as `tenant` sees it: its own responses only,
        so another tenant's response id finds, replaces and deletes nothing."""
        view = ResponseStore(self.capacity)
        view._stored = self._stored
        view._scope = f"{tenant}/"
        return view

    def __len__(self) -> int:
        return len(self._stored)

    def put(self, response_id: str, conversation: Conversation, response: dict[str, Any]) -> None:
        if self.capacity == 0:
            return
        response_id = self._scope + response_id
        self._stored[response_id] = Stored(conversation, response)
        self._stored.move_to_end(response_id)
        while len(self._stored) > self.capacity:
            self._stored.popitem(last=False)

    def get(self, response_id: str) -> Conversation | None:
        """The conversation up to and including that response; None if unknown or dropped."""
        stored = self._lookup(response_id)
        return None if stored is None else stored.conversation

    def response(self, response_id: str) -> dict[str, Any] | None:
        """The Response object; None if unknown, dropped or deleted."""
        stored = self._lookup(response_id)
        return None if stored is None else stored.response

    def delete(self, response_id: str) -> bool:
        return self._stored.pop(self._scope + response_id, None) is not None

    def _lookup(self, response_id: str) -> Stored | None:
        response_id = self._scope + response_id
        stored = self._stored.get(response_id)
        if stored is not None:
            self._stored.move_to_end(response_id)
        return stored
