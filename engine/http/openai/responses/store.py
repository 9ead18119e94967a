"""Finished Responses API responses, kept for `previous_response_id`: each one's conversation
(its input messages and its answer, as chat messages), in memory, the least recently used
dropped past `capacity` (server.responses_store_size)."""

from __future__ import annotations

from collections import OrderedDict

from engine.messages.requests import ChatMessage

Conversation = list[ChatMessage]


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._conversations: OrderedDict[str, Conversation] = OrderedDict()

    def __len__(self) -> int:
        return len(self._conversations)

    def put(self, response_id: str, conversation: Conversation) -> None:
        if self.capacity == 0:
            return
        self._conversations[response_id] = conversation
        self._conversations.move_to_end(response_id)
        while len(self._conversations) > self.capacity:
            self._conversations.popitem(last=False)

    def get(self, response_id: str) -> Conversation | None:
        """The conversation up to and including that response; None if unknown or dropped."""
        conversation = self._conversations.get(response_id)
        if conversation is not None:
            self._conversations.move_to_end(response_id)
        return conversation
