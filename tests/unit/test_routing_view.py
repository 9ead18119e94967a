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
        request_id="r",
        epoch=3,
        params=SamplingParams(n=2, max_tokens=7, stop=["x"]),
        seed=11,
        prompt="hello",
        prompt_token_ids=[5, 6, 7],
        messages=[ChatMessage("user", "hi", name="u")],
        resume=[SampleResume(1, [8, 9])],
        chat=ChatOptions("{{ x }}", {"a": 1}, False),
        kv_handoff="continue",
    )
    frame = GATEWAY_TO_TOKENIZER.encode(request)
    view = _view(request)
    assert ROUTING.encode(view) == frame
    assert (view.request_id, view.epoch, view.params, view.kv_handoff) == (
        "r",
        3,
        request.params,
        "continue",
    )
    assert view.chat_messages() == request.messages
    assert view.resumed_samples() == request.resume
    # A changed directive changes that field alone.
    changed = msgspec.structs.replace(view, kv_handoff="hold")
    assert GATEWAY_TO_TOKENIZER.decode(ROUTING.encode(changed)) == msgspec.structs.replace(
        request, kv_handoff="hold"
    )


@pytest.mark.parametrize("length", [0, 15, 16, 1000, 65535, 65536])
def test_the_prompt_length_is_read_off_the_array_header(length: int) -> None:
    request = GenerateRequest("r", 0, SamplingParams(), 1, prompt_token_ids=[7] * length)
    assert _view(request).num_prompt_token_ids() == length


def test_a_text_prompt_has_no_token_count_yet() -> None:
    view = _view(GenerateRequest("r", 0, SamplingParams(), 1, prompt="some text"))
    assert view.num_prompt_token_ids() is None
    assert (view.prompt, view.chat_messages(), view.resumed_samples()) == ("some text", None, None)
