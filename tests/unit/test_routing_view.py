"""The data-parallel router's view of a GenerateRequest frame: field for field the same frame,
with the prompt read only by its length."""

from __future__ import annotations

import msgspec
import pytest

from engine.messages.params import SamplingParams
from engine.messages.requests import (
    GATEWAY_TO_TOKENIZER,
    ROUTING,
    ChatMessage,
    ChatOptions,
    EngineRequest,
    GenerateRequest,
    RoutingView,
)
from engine.messages.scheduling import SampleResume


def _view(request: GenerateRequest) -> RoutingView:
    view = ROUTING.decode(GATEWAY_TO_TOKENIZER.encode(request))
    assert isinstance(view, RoutingView)
    return view


def test_the_view_encodes_back_to_the_very_frame_with_every_field_set() -> None:
    request = GenerateRequest(
        EngineRequest(
            request_id="r",
            params=SamplingParams(n=2, max_tokens=7, stop=["x"]),
            prompt="hello",
            prompt_token_ids=[5, 6, 7],
            messages=[ChatMessage("user", "hi", name="u")],
            chat=ChatOptions("{{ x }}", {"a": 1}, False),
            kv_handoff="continue",
            kv_transfer_params={"do_remote_decode": True},
            trace_headers={"traceparent": "00-ab-cd-01"},
            defaulted_fields=frozenset({"top_k"}),
            field_names={"stop": "stop_sequences"},
        ),
        epoch=3,
        seed=11,
        resume=[SampleResume(1, [8, 9])],
    )
    frame = GATEWAY_TO_TOKENIZER.encode(request)
    view = _view(request)
    assert ROUTING.encode(view) == frame
    assert (view.request_id, view.epoch, view.request.params, view.request.kv_handoff) == (
        "r",
        3,
        request.params,
        "continue",
    )
    assert view.chat_messages() == request.request.messages
    assert view.resumed_samples() == request.resume
    # A changed directive changes that field alone.
    changed = msgspec.structs.replace(view.request, kv_handoff="hold")
    held = msgspec.structs.replace(request.request, kv_handoff="hold")
    decoded = GATEWAY_TO_TOKENIZER.decode(
        ROUTING.encode(msgspec.structs.replace(view, request=changed))
    )
    assert decoded == msgspec.structs.replace(request, request=held)


@pytest.mark.parametrize("length", [0, 15, 16, 1000, 65535, 65536])
def test_the_prompt_length_is_read_off_the_array_header(length: int) -> None:
    request = GenerateRequest(EngineRequest(prompt_token_ids=[7] * length), 0, 1)
    assert _view(request).num_prompt_token_ids() == length


def test_a_text_prompt_has_no_token_count_yet() -> None:
    view = _view(GenerateRequest(EngineRequest(prompt="some text"), 0, 1))
    assert view.num_prompt_token_ids() is None
    text = view.request.prompt
    assert (text, view.chat_messages(), view.resumed_samples()) == ("some text", None, None)
