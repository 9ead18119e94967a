"""GGUF files from the command line: a bad file or a missing one stops `engine serve` with one line
saying what is wrong, and `engine export` writes a checkpoint into a new directory only (its
weights are checked against the file's in tests/unit/test_gguf_model.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoints import tiny_checkpoint
from tests.e2e.harness import REPO
from tests.gguf_files import gguf_of


def engine_cli(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ENGINE_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "engine", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    """What a failed start printed: one line, nothing logged before or after it."""
    return result.stderr.splitlines()


def bad_model(case: str, tmp_path: Path) -> Path:
    good = gguf_of(tiny_checkpoint("qwen3"), "Q8_0")[0].read_bytes()
    path = tmp_path / f"{case}.gguf"
    if case == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif case == "magic":
        path.write_bytes(b"NOPE" + good[4:])
    return path  # "no such file": not written


@pytest.mark.parametrize("case", ["truncated", "magic", "no such file"])
def test_a_bad_model_stops_the_start_with_one_line(tmp_path: Path, case: str) -> None:
    path = bad_model(case, tmp_path)
    result = engine_cli("--model", str(path), "--port", "0", home=tmp_path / "home")
    assert result.returncode != 0
    [line] = error_lines(result)
    assert path.name in line and case in line, line


def test_export_writes_a_checkpoint_and_keeps_off_a_used_directory(tmp_path: Path) -> None:
    gguf_file, _ = gguf_of(tiny_checkpoint("llama"), "Q4_0")
    out = tmp_path / "exported"
    result = engine_cli("export", str(gguf_file), str(out), home=tmp_path / "home")
    assert result.returncode == 0, result.stderr
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    again = engine_cli("export", str(gguf_file), str(out), home=tmp_path / "home")
    assert again.returncode == 1 and "not empty" in again.stderr
