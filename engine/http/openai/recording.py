"""What one API request adds to the trace (`--record-trace`): collected while it is served,
handed to the trace recorder (engine/trace/recorder.py) as one TraceRecord when it ends."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from engine.http.openai.bodies import ChoiceState
from engine.http.openai.parsing import PreparedRequest
from engine.trace.format import TRACE_VERSION, Endpoint, RecordedChoice, TraceRecord


class RequestRecording:
    """What one API request adds to the trace, collected while it is served."""

    __slots__ = ("_arrival", "_body", "_endpoint", "_times", "_tokens")

    def __init__(self, endpoint: str, body: bytes, arrival: float) -> None:
        self._endpoint = endpoint
        self._body = body
        self._arrival = arrival  # Unix time
        # By choice index, made as tokens arrive: a request may be refused for its size.
        self._tokens: dict[int, list[int]] = {}
        self._times: dict[int, list[float]] = {}

    def tokens_delivered(self, choice: int, token_ids: Sequence[int], after: float) -> None:
        """`token_ids` of `choice` left the server `after` seconds from arrival."""
        self._tokens.setdefault(choice, []).extend(token_ids)
        self._times.setdefault(choice, []).extend([round(after, 6)] * len(token_ids))

    def record(
        self,
        prepared: PreparedRequest,
        choices: Sequence[ChoiceState],
        *,
        outcome: str,
        status: int,
        prompt_tokens: int,
        completion_tokens: int,
        ttft: float | None,
        e2e: float,
    ) -> TraceRecord:
        endpoint: Endpoint = (
            "chat_completions" if self._endpoint == "chat_completions" else "completions"
        )
        return TraceRecord(
            v=TRACE_VERSION,
            arrival=round(self._arrival, 6),
            endpoint=endpoint,
            body=msgspec.Raw(self._body),
            request_id=prepared.request_id,
            stream=prepared.stream,
            n=prepared.n,
            max_tokens=prepared.params.max_tokens,
            outcome=outcome,
            status=status,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            ttft=None if ttft is None else round(ttft, 6),
            e2e=round(e2e, 6),
            choices=[
                RecordedChoice(
                    index=c.index,
                    text=c.text,
                    finish_reason=c.finish_reason,
                    token_ids=self._tokens.get(c.index, []),
                    token_times=self._times.get(c.index, []),
                )
                for c in choices
            ],
        )
