"""Importers: Mooncake and Azure files written here, and the Poisson workload, all become the
same trace format; equal Mooncake hash_ids give equal prompt prefixes; bad rows are reported by
line number and the others imported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.trace.format import TraceRecord, encode_record, parse_lines
from engine.trace.importers import (
    ImportOptions,
    TraceImportError,
    import_azure,
    import_mooncake,
    poisson_workload,
)
from engine.trace.synth import PromptSynth, TokenRange

BLOCK = 8


def options(**overrides: object) -> ImportOptions:
    fields: dict[str, object] = {"synth": PromptSynth(BLOCK), "input_scale": BLOCK / 512}
    fields.update(overrides)
    return ImportOptions(**fields)  # type: ignore[arg-type]


def prompts(records: list[TraceRecord]) -> list[list[int]]:
    return [r.request_body()["prompt"] for r in records]


def write_mooncake(path: Path, rows: list[dict[str, object] | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_mooncake_equal_hash_ids_give_equal_prefix_blocks(tmp_path: Path) -> None:
    source = write_mooncake(
        tmp_path / "m.jsonl",
        [
            {"timestamp": 0, "input_length": 1200, "output_length": 10, "hash_ids": [0, 1, 2]},
            {"timestamp": 500, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 3]},
            {"timestamp": 1500, "input_length": 600, "output_length": 5, "hash_ids": [4, 5]},
        ],
    )
    result = import_mooncake(source, options())
    assert not result.problems and result.rows_read == 3
    a, b, c = prompts(result.records)
    # 1200 tokens at 512 per block → 19 at 8 per block: two shared blocks, then their own.
    assert (len(a), len(b), len(c)) == (19, 18, 10)
    assert (a[: 2 * BLOCK] == b[: 2 * BLOCK] and a[2 * BLOCK] != b[2 * BLOCK]) or a[16:] != b[16:]
    assert a[:BLOCK] != c[:BLOCK]
    assert all(100 <= t < 500 for p in (a, b, c) for t in p)
    assert [r.arrival for r in result.records] == [0.0, 0.5, 1.5]
    bodies = [r.request_body() for r in result.records]
    assert [b["max_tokens"] for b in bodies] == [10, 20, 5]
    assert all(b["temperature"] == 0.0 and b["ignore_eos"] is True for b in bodies)
    assert {r.source for r in result.records} == {"mooncake"}


def test_mooncake_prefixes_repeat_across_imports_and_text_prompts_share_too(
    tmp_path: Path,
) -> None:
    rows: list[dict[str, object] | str] = [
        {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [7, 8]},
        {"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [7, 9]},
    ]
    source = write_mooncake(tmp_path / "m.jsonl", rows)
    assert prompts(import_mooncake(source, options()).records) == prompts(
        import_mooncake(source, options()).records
    )
    text = options(synth=PromptSynth(BLOCK, "text"))
    first, second = (r.request_body()["prompt"] for r in import_mooncake(source, text).records)
    assert first.split()[:BLOCK] == second.split()[:BLOCK]
    assert first.split()[BLOCK:] != second.split()[BLOCK:]


def test_mooncake_scaling_window_and_limit(tmp_path: Path) -> None:
    row = {"input_length": 5000, "output_length": 900, "hash_ids": list(range(10))}
    rows: list[dict[str, object] | str] = [{"timestamp": t * 1000, **row} for t in range(10)]
    source = write_mooncake(tmp_path / "m.jsonl", rows)
    result = import_mooncake(source, options(max_input=30, max_output=16, window=(2.0, 6.0)))
    assert [r.arrival for r in result.records] == [2.0, 3.0, 4.0, 5.0]
    assert {len(p) for p in prompts(result.records)} == {30}
    assert {r.request_body()["max_tokens"] for r in result.records} == {16}
    limited = import_mooncake(source, options(window=(2.0, 6.0), limit=2))
    assert [r.arrival for r in limited.records] == [2.0, 3.0]


def test_mooncake_bad_lines_are_reported_by_number(tmp_path: Path) -> None:
    source = write_mooncake(
        tmp_path / "m.jsonl",
        [
            {"timestamp": 0, "input_length": 100, "output_length": 1, "hash_ids": [0]},
            "{oops",
            {"timestamp": 1, "output_length": 1, "hash_ids": [0]},
            {"timestamp": 2, "input_length": 0, "output_length": 1},
            {"timestamp": 3, "input_length": "many", "output_length": 1},
            {"timestamp": 4, "input_length": 100, "output_length": 1},
        ],
    )
    result = import_mooncake(source, options())
    assert len(result.records) == 2 and result.rows_read == 6
    problems = {p.line: p.message for p in result.problems}
    assert set(problems) == {2, 3, 4, 5}
    assert "not valid JSON" in problems[2]
    assert "missing required field `input_length`" in problems[3]
    assert "input_length must be >= 1, got 0" in problems[4]
    assert "$.input_length" in problems[5]


AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51,12,x
not a time,10,10
2023-11-16 18:15:52.5000000,2000,3
2023-11-16 18:15:53.0000000,,3
"""


def test_azure_rows_become_requests_with_their_own_prompts(tmp_path: Path) -> None:
    source = tmp_path / "azure.csv"
    source.write_text(AZURE)
    result = import_azure(source, options(input_scale=0.1, max_output=50))
    assert [r.arrival for r in result.records] == pytest.approx([0.0, 4.314579, 5.81941])
    bodies = [r.request_body() for r in result.records]
    assert [len(b["prompt"]) for b in bodies] == [38, 40, 200]
    assert [b["max_tokens"] for b in bodies] == [44, 50, 3]
    a, b, _ = (b["prompt"] for b in bodies)
    assert a[:8] != b[:8]  # no shared prefixes: the trace has no such information
    problems = {p.line: p.message for p in result.problems}
    assert set(problems) == {4, 5, 7}
    assert "GeneratedTokens must be an integer token count, got 'x'" in problems[4]
    assert "TIMESTAMP 'not a time' is not a date-time" in problems[5]
    assert "missing field ContextTokens" in problems[7]


def test_an_azure_file_without_its_columns_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "azure.csv"
    source.write_text("time,input,output\n1,2,3\n")
    with pytest.raises(TraceImportError, match=r"missing column.*TIMESTAMP.*expected header"):
        import_azure(source, options())
    with pytest.raises(TraceImportError, match="cannot read"):
        import_azure(tmp_path / "absent.csv", options())


def test_poisson_workload_is_seeded_and_sized() -> None:
    make = lambda seed: poisson_workload(  # noqa: E731
        rate=20.0, num=200, input_len=12, output_len=5, options=options(input_scale=1), seed=seed
    )
    first, again, other = make(1), make(1), make(2)
    arrivals = [r.arrival for r in first.records]
    assert len(arrivals) == 200 and arrivals[0] == 0.0
    assert arrivals == sorted(arrivals) and arrivals == [r.arrival for r in again.records]
    assert arrivals != [r.arrival for r in other.records]
    # 199 exponential gaps of mean 1/20 s: their mean is within a few standard errors of it.
    assert arrivals[-1] / 199 == pytest.approx(1 / 20, rel=0.35)
    assert {len(p) for p in prompts(first.records)} == {12}
    assert {r.request_body()["max_tokens"] for r in first.records} == {5}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate": 0.0}, "--rate must be > 0"),
        ({"num": 0}, "--num must be >= 1"),
        ({"input_len": 0}, "--input-len must be >= 1"),
    ],
)
def test_poisson_refuses_bad_values(kwargs: dict[str, float], message: str) -> None:
    params = {"rate": 1.0, "num": 1, "input_len": 1, "output_len": 1, **kwargs}
    with pytest.raises(ValueError, match=message):
        poisson_workload(**params, options=options())  # type: ignore[arg-type]


def test_chat_imports_carry_text_messages_and_round_trip() -> None:
    result = poisson_workload(
        rate=1.0,
        num=2,
        input_len=5,
        output_len=2,
        options=options(
            synth=PromptSynth(BLOCK, "text"), endpoint="chat_completions", model="m", input_scale=1
        ),
    )
    trace = parse_lines([encode_record(r) for r in result.records])
    assert not trace.problems and len(trace.entries) == 2
    body = trace.entries[0].body
    assert body["model"] == "m" and len(body["messages"][0]["content"].split()) == 5


def test_a_token_range_must_be_ordered() -> None:
    with pytest.raises(ValueError, match="0 <= LOW < HIGH, got 5:5"):
        TokenRange(5, 5)
