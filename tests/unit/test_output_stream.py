"""A request's output stream stays bounded for a client that does not read, loses nothing, and
says how long it has been stalled."""

from __future__ import annotations

from engine.inflight.output_stream import OutputStream
from engine.request.outputs import CompletionOutput, EngineError, RequestOutput


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def output(step: int, finished: bool = False) -> RequestOutput:
    parts = [CompletionOutput(i, f"<{i}:{step}>", [step], None) for i in range(2)]
    if finished:
        parts[0].finish_reason = "length"
    return RequestOutput("r", None, [1], parts, finished)


async def test_a_full_stream_merges_new_outputs_and_the_reader_still_gets_every_token() -> None:
    stream = OutputStream(capacity=3)
    for step in range(50):
        stream.put_nowait(output(step, finished=step == 49))
    assert len(stream) == 3
    items = [await stream.get() for _ in range(3)]
    assert stream.empty()
    for index in range(2):
        tokens = [
            t for item in items for o in item.outputs if o.index == index for t in o.token_ids
        ]
        text = "".join(o.text for item in items for o in item.outputs if o.index == index)
        assert tokens == list(range(50))
        assert text == "".join(f"<{index}:{step}>" for step in range(50))
    assert items[-1].finished and items[-1].outputs[0].finish_reason == "length"


async def test_an_error_is_never_merged_away() -> None:
    stream = OutputStream(capacity=1)
    stream.put_nowait(output(0))
    stream.put_nowait(EngineError("boom", 500))
    assert isinstance(stream.get_nowait(), RequestOutput)
    assert isinstance(stream.get_nowait(), EngineError)


def test_stalled_time_counts_from_when_the_stream_filled_until_the_reader_takes_one() -> None:
    clock = Clock()
    stream = OutputStream(capacity=2, clock=clock)
    stream.put_nowait(output(0))
    clock.now += 5
    assert stream.stalled_for() == 0.0  # not full: a slow reader is not a stalled one
    stream.put_nowait(output(1))
    clock.now += 7
    stream.put_nowait(output(2))  # merged; the stall goes on
    assert stream.stalled_for() == 7.0
    stream.get_nowait()
    assert stream.stalled_for() == 0.0
