"""Public traces and synthetic workloads → our trace format.

- Mooncake (JSONL: `timestamp` ms, `input_length`, `output_length`, `hash_ids` — one id per
  512-token block, equal ids meaning equal blocks): prompts are built block by block so equal
  ids give equal prefixes. `block_tokens` shrinks the 512-token block (and every input length
  in proportion) for small models.
- Azure LLM inference trace (CSV: `TIMESTAMP`, `ContextTokens`, `GeneratedTokens`): prompts of
  their own, no shared prefixes (the trace has no such information).
- Poisson: `num` requests at `rate` per second (exponential gaps), fixed lengths.

Arrivals are seconds after the source trace's first request. Bad rows become `TraceProblem`s
with their line numbers; the other rows are imported.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

import msgspec

from engine.trace.format import (
    TRACE_VERSION,
    Endpoint,
    TraceProblem,
    TraceRecord,
    explain_decode_error,
    make_body,
)
from engine.trace.synth import PromptSynth, request_body

MOONCAKE_BLOCK_TOKENS = 512
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceImportError(Exception):
    """The whole source is unusable (unreadable, wrong columns); row errors are problems."""


@dataclass(frozen=True)
class ImportOptions:
    """How source rows become requests."""

    synth: PromptSynth
    endpoint: Endpoint = "completions"
    model: str | None = None
    ignore_eos: bool = True
    input_scale: float = 1.0  # multiplies input lengths (Mooncake: block_tokens / 512)
    output_scale: float = 1.0
    max_input: int | None = None
    max_output: int | None = None
    window: tuple[float, float] | None = None  # seconds after the first request: [start, end)
    limit: int | None = None

    def input_len(self, tokens: int) -> int:
        scaled = max(1, math.ceil(tokens * self.input_scale))
        return scaled if self.max_input is None else min(scaled, self.max_input)

    def output_len(self, tokens: int) -> int:
        scaled = max(1, math.ceil(tokens * self.output_scale))
        return scaled if self.max_output is None else min(scaled, self.max_output)


@dataclass
class ImportResult:
    records: list[TraceRecord] = field(default_factory=list)
    problems: list[TraceProblem] = field(default_factory=list)
    rows_read: int = 0


@dataclass(frozen=True)
class _Row:
    line: int
    arrival: float  # seconds, source clock
    input_tokens: int
    output_tokens: int
    block_ids: list[int]


class MooncakeRow(msgspec.Struct):
    timestamp: float  # milliseconds
    input_length: int
    output_length: int
    hash_ids: list[int] = []


_MOONCAKE_DECODER = msgspec.json.Decoder(MooncakeRow)


def import_mooncake(path: str | Path, options: ImportOptions) -> ImportResult:
    rows: list[_Row] = []
    problems: list[TraceProblem] = []
    for number, raw in _lines(path):
        line = raw.strip()
        if not line:
            continue
        try:
            row = _MOONCAKE_DECODER.decode(line)
        except msgspec.DecodeError as e:
            problems.append(TraceProblem(number, explain_decode_error(e)))
            continue
        bad = _bad_lengths(row.input_length, row.output_length, "input_length", "output_length")
        if bad:
            problems.append(TraceProblem(number, bad))
            continue
        rows.append(
            _Row(number, row.timestamp / 1000.0, row.input_length, row.output_length, row.hash_ids)
        )
    return _to_records(rows, problems, options, source="mooncake")


def import_azure(path: str | Path, options: ImportOptions) -> ImportResult:
    rows: list[_Row] = []
    problems: list[TraceProblem] = []
    with _open_text(path) as f:
        reader = csv.DictReader(f)
        missing = [c for c in AZURE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            found = ",".join(reader.fieldnames or [])
            raise TraceImportError(
                f"{path}: not an Azure LLM trace: missing column(s) {', '.join(missing)} "
                f"(expected header {','.join(AZURE_COLUMNS)}, got {found!r})"
            )
        for record in reader:
            number = reader.line_num
            try:
                arrival = _azure_time(record["TIMESTAMP"])
                context = _int_field(record, "ContextTokens")
                generated = _int_field(record, "GeneratedTokens")
            except ValueError as e:
                problems.append(TraceProblem(number, str(e)))
                continue
            bad = _bad_lengths(context, generated, "ContextTokens", "GeneratedTokens")
            if bad:
                problems.append(TraceProblem(number, bad))
                continue
            rows.append(_Row(number, arrival, context, generated, []))
    return _to_records(rows, problems, options, source="azure")


def poisson_workload(
    *, rate: float, num: int, input_len: int, output_len: int, options: ImportOptions, seed: int = 0
) -> ImportResult:
    if not rate > 0:
        raise ValueError(f"--rate must be > 0 requests per second, got {rate}")
    for name, value in (("--num", num), ("--input-len", input_len), ("--output-len", output_len)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    rng = random.Random(seed)
    rows: list[_Row] = []
    now = 0.0
    for i in range(num):
        rows.append(_Row(i + 1, now, input_len, output_len, []))
        now += rng.expovariate(rate)
    return _to_records(rows, [], options, source="poisson")


def _to_records(
    rows: list[_Row], problems: list[TraceProblem], options: ImportOptions, source: str
) -> ImportResult:
    result = ImportResult(problems=problems, rows_read=len(rows) + len(problems))
    if not rows:
        return result
    start = min(r.arrival for r in rows)
    for row in sorted(rows, key=lambda r: (r.arrival, r.line)):
        offset = row.arrival - start
        if options.window is not None and not options.window[0] <= offset < options.window[1]:
            continue
        if options.limit is not None and len(result.records) >= options.limit:
            break
        prompt = options.synth.prompt(
            options.input_len(row.input_tokens), row.block_ids, f"{source}:{row.line}"
        )
        body = request_body(
            options.endpoint,
            prompt,
            options.output_len(row.output_tokens),
            model=options.model,
            ignore_eos=options.ignore_eos,
        )
        result.records.append(
            TraceRecord(
                v=TRACE_VERSION,
                arrival=round(offset, 6),
                endpoint=options.endpoint,
                body=make_body(body),
                source=source,
                request_id=f"{source}-{row.line}",
            )
        )
    return result


def _azure_time(text: str) -> float:
    try:
        # 7 fractional digits in the public files; fromisoformat keeps microseconds.
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"TIMESTAMP {text!r} is not a date-time like '2023-11-16 18:15:46.6805900'"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def _int_field(record: dict[str, str | None], name: str) -> int:
    value = record.get(name)
    if value is None or value.strip() == "":
        raise ValueError(f"missing field {name}")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer token count, got {value!r}") from None


def _bad_lengths(inp: int, out: int, in_name: str, out_name: str) -> str | None:
    if inp < 1:
        return f"{in_name} must be >= 1, got {inp}"
    if out < 0:
        return f"{out_name} must be >= 0, got {out}"
    return None


def _lines(path: str | Path) -> Iterable[tuple[int, bytes]]:
    try:
        with open(path, "rb") as f:
            yield from enumerate(f, start=1)
    except OSError as e:
        raise TraceImportError(f"cannot read {path}: {e.strerror or e}") from None


def _open_text(path: str | Path) -> IO[str]:
    try:
        return open(path, newline="", encoding="utf-8")
    except OSError as e:
        raise TraceImportError(f"cannot read {path}: {e.strerror or e}") from None
