"""The Responses API's store of finished conversations (previous_response_id): bounded, least
recently used dropped first."""

from __future__ import annotations

from engine.http.openai.responses.store import ResponseStore


def turn(text: str) -> list[dict[str, object]]:
    return [{"role": "user", "content": text}, {"role": "assistant", "content": text.upper()}]


def test_the_least_recently_used_is_dropped_past_the_capacity() -> None:
    store = ResponseStore(2)
    store.put("resp_a", turn("a"))
    store.put("resp_b", turn("b"))
    assert store.get("resp_a") == turn("a")  # now more recently used than resp_b
    store.put("resp_c", turn("c"))
    assert len(store) == 2
    assert store.get("resp_b") is None
    assert store.get("resp_a") == turn("a") and store.get("resp_c") == turn("c")


def test_capacity_zero_keeps_nothing() -> None:
    store = ResponseStore(0)
    store.put("resp_a", turn("a"))
    assert len(store) == 0 and store.get("resp_a") is None
