"""The trace recorder writes off the serving path and never takes serving down with it: a full
disk (/dev/full answers every write with ENOSPC) or an unwritable path stops recording with one
log line, and submitting afterwards is still harmless."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import msgspec
import pytest

from engine.trace.format import TraceRecord, make_body, read_trace
from engine.trace.recorder import TraceRecorder, being_recorded


def record(i: int, body: msgspec.Raw | None = None) -> TraceRecord:
    return TraceRecord(
        v=1,
        arrival=float(i),
        endpoint="completions",
        body=body or make_body({"prompt": f"p{i}", "max_tokens": 1}),
        request_id=f"r{i}",
        outcome="success",
        status=200,
    )


def test_records_are_appended_in_order_and_close_flushes_them(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"")
    recorder = TraceRecorder(str(path))
    for i in range(500):
        recorder.submit(record(i))
    recorder.close()
    trace = read_trace(path)
    assert not trace.problems
    assert [e.record.request_id for e in trace.entries] == [f"r{i}" for i in range(500)]
    assert recorder.written == 500 and recorder.dropped == 0 and recorder.active


def test_a_trace_being_recorded_is_known_and_says_how_it_was_served(tmp_path: Path) -> None:
    """`engine replay` refuses a file a server still appends to (its replay would land in it);
    each record says whether its server ran --deterministic (replay --compare is exact then)."""
    path = tmp_path / "trace.jsonl"
    recorder = TraceRecorder(str(path), deterministic=True)
    assert being_recorded(str(path))
    recorder.submit(record(0))
    recorder.close()
    assert not being_recorded(str(path))
    (entry,) = read_trace(path).entries
    assert entry.record.deterministic
    TraceRecorder(str(path)).close()
    assert not being_recorded(str(tmp_path / "absent.jsonl"))


def test_a_pretty_printed_body_stays_on_one_line(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    recorder = TraceRecorder(str(path))
    recorder.submit(record(0, msgspec.Raw(b'{\r\n  "prompt": "a\\nb",\n  "max_tokens": 1\n}')))
    recorder.close()
    (entry,) = read_trace(path).entries
    assert entry.body == {"prompt": "a\nb", "max_tokens": 1}


def test_a_full_disk_stops_recording_with_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    caplog.set_level(logging.ERROR, logger="engine.trace")
    recorder = TraceRecorder("/dev/full")
    recorder.submit(record(0))
    recorder.close()
    assert not recorder.active
    (message,) = [r.getMessage() for r in caplog.records if r.name == "engine.trace"]
    assert "trace recording stopped" in message and "/dev/full" in message
    assert "No space left on device" in message and "serving continues" in message
    recorder.submit(record(1))  # after the failure: counted, not raised
    assert recorder.dropped == 2 and recorder.written == 0


def test_an_unopenable_path_disables_recording(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="engine.trace")
    recorder = TraceRecorder(str(tmp_path / "no-such-dir" / "trace.jsonl"))
    assert not recorder.active
    recorder.submit(record(0))
    recorder.close()
    assert any("cannot open" in r.getMessage() for r in caplog.records)


def test_with_a_bounded_queue_every_record_is_written_or_counted_as_dropped(tmp_path: Path) -> None:
    recorder = TraceRecorder(str(tmp_path / "t.jsonl"), max_pending=1)
    for i in range(5000):
        recorder.submit(record(i))
    recorder.close()
    assert recorder.written + recorder.dropped == 5000
    assert len(read_trace(tmp_path / "t.jsonl").entries) == recorder.written


@pytest.mark.parametrize("umask", [0o022, 0o277, 0o000])
def test_the_trace_file_is_owner_only_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    path = tmp_path / "trace.jsonl"
    previous = os.umask(umask)
    try:
        recorder = TraceRecorder(str(path))
    finally:
        os.umask(previous)
    recorder.submit(record(0))
    recorder.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(read_trace(path).entries) == 1


def test_appending_to_a_loose_file_of_ours_makes_it_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"")
    path.chmod(0o644)  # as an earlier run under the default umask left it
    recorder = TraceRecorder(str(path))
    recorder.submit(record(0))
    recorder.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(read_trace(path).entries) == 1
