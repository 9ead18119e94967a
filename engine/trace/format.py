"""The trace format: one JSON object per line, one line per request, versioned by its `v` field.

A trace is what `--record-trace` writes and what the importers (Mooncake, Azure, Poisson)
produce; replay reads both the same way. Recorded lines carry the outcome (status, text, token
ids and the time each token was delivered); imported lines carry only arrival and request body.

Reading never stops at a bad line: every malformed line becomes a `TraceProblem` naming its line
number and what was wrong, and the rest of the file is still returned.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

import msgspec

TRACE_VERSION = 1
ENDPOINT_PATHS = {"completions": "/v1/completions", "chat_completions": "/v1/chat/completions"}

Endpoint = Literal["completions", "chat_completions"]


class RecordedChoice(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One generated sample as the server delivered it."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    token_ids: list[int] = msgspec.field(default_factory=list)
    # Seconds after arrival at which each token left the server (tokens of one engine output
    # share a time), so len(token_times) == len(token_ids).
    token_times: list[float] = msgspec.field(default_factory=list)


class TraceRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One request of a trace (format version 1)."""

    v: int  # the format version: always written, checked on reading
    # Seconds on any clock: recordings use Unix time, imports the source trace's own clock.
    # Replay only uses differences between arrivals.
    arrival: float
    endpoint: Endpoint
    # The request body exactly as the client sent it (a JSON object), kept as raw JSON so the
    # recorder never re-encodes it on the serving path.
    body: msgspec.Raw
    source: str = "recorded"  # recorded | mooncake | azure | poisson
    request_id: str | None = None
    stream: bool | None = None
    n: int | None = None
    max_tokens: int | None = None
    # The outcome; absent in imported traces.
    outcome: str | None = None  # success | aborted | rejected | bad_request | error | ...
    status: int | None = None  # HTTP status the server answered with (200, or the error's)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft: float | None = None  # seconds from arrival to the first token delivered
    e2e: float | None = None  # seconds from arrival to the end of the response
    choices: list[RecordedChoice] = msgspec.field(default_factory=list)
    # Served by a --deterministic server (batch-invariant kernels): its greedy and seeded
    # outputs do not depend on the batch or the prefix cache, so a replay can match them exactly.
    deterministic: bool = False

    def request_body(self) -> dict[str, Any]:
        body = msgspec.json.decode(self.body)
        if not isinstance(body, dict):
            raise ValueError(f"'body' must be a JSON object, got {type(body).__name__}")
        return body

    @property
    def recorded(self) -> bool:
        """Whether this line holds a server's outcome (not just a request to send)."""
        return self.outcome is not None


@dataclass(frozen=True)
class TraceProblem:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


@dataclass(frozen=True)
class TraceEntry:
    """A well-formed line: its number in the file, the record and its decoded body."""

    line: int
    record: TraceRecord
    body: dict[str, Any]


@dataclass
class Trace:
    entries: list[TraceEntry]
    problems: list[TraceProblem]


_RECORD_DECODER = msgspec.json.Decoder(TraceRecord)
_ENCODER = msgspec.json.Encoder()


def encode_record(record: TraceRecord) -> bytes:
    """One line of the trace, newline included."""
    return _ENCODER.encode(record) + b"\n"


def make_body(body: dict[str, Any]) -> msgspec.Raw:
    return msgspec.Raw(msgspec.json.encode(body))


def parse_line(number: int, line: bytes) -> TraceEntry | TraceProblem:
    try:
        record = _RECORD_DECODER.decode(line)
    except msgspec.DecodeError as e:
        return TraceProblem(number, explain_decode_error(e))
    if record.v != TRACE_VERSION:
        return TraceProblem(
            number, f"trace format version {record.v} is not supported (expected {TRACE_VERSION})"
        )
    try:
        body = record.request_body()
    except (msgspec.DecodeError, ValueError) as e:
        return TraceProblem(number, f"invalid 'body': {e}")
    return TraceEntry(number, record, body)


def parse_lines(lines: Iterable[bytes]) -> Trace:
    entries: list[TraceEntry] = []
    problems: list[TraceProblem] = []
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line:
            continue
        parsed = parse_line(number, line)
        if isinstance(parsed, TraceProblem):
            problems.append(parsed)
        else:
            entries.append(parsed)
    return Trace(entries, problems)


def read_trace(path: str | Path) -> Trace:
    """Every well-formed line of a trace file, and a problem for each malformed one."""
    with open(path, "rb") as f:
        return parse_lines(f)


def write_trace(records: Iterable[TraceRecord], out: IO[bytes]) -> int:
    count = 0
    for record in records:
        out.write(encode_record(record))
        count += 1
    return count


def explain_decode_error(error: msgspec.DecodeError) -> str:
    """msgspec's message in the words the trace reports use."""
    text = str(error)
    if isinstance(error, msgspec.ValidationError):
        return text.replace("Object missing required field", "missing required field")
    return f"not valid JSON ({text})"
