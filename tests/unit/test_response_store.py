"""The Responses API's store of finished conversations (previous_response_id): bounded, least
recently used dropped first."""

from __future__ import annotations

from engine.http.openai.responses.store import ResponseStore


def turn(text: str) -> list[dict[str, object]]:
    return [{"role": "user", "content": text}, {"role": "assistant", "content": text.upper()}]


def put(store: ResponseStore, response_id: str, text: str) -> None:
    store.put(response_id, turn(text), {"id": response_id, "output_text": text.upper()})


def test_the_least_recently_used_is_dropped_past_the_capacity() -> None:
    store = ResponseStore(2)
    put(store, "resp_a", "a")
    put(store, "resp_b", "b")
    assert store.get("resp_a") == turn("a")  # now more recently used than resp_b
    put(store, "resp_c", "c")
    assert len(store) == 2
    assert store.get("resp_b") is None
    assert store.get("resp_a") == turn("a") and store.get("resp_c") == turn("c")
    assert store.response("resp_c") == {"id": "resp_c", "output_text": "C"}
    assert store.delete("resp_c") and store.response("resp_c") is None


def test_capacity_zero_keeps_nothing() -> None:
    store = ResponseStore(0)
    put(store, "resp_a", "a")
    assert len(store) == 0 and store.get("resp_a") is None
