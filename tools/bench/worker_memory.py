"""Resident memory of a started engine's processes, per `--quantization` value, one after the
other: the worker's RSS (the largest process), what of it is anonymous memory, and whether any of
the GGUF file is still mapped.

    python tools/bench/worker_memory.py                       # the default model, auto vs none
    python tools/bench/worker_memory.py --model F.gguf --quantization auto q8_0 none
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `engine` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def rss_mib(pid: int, mapping: str | None = None) -> float:
    """Resident MiB of a process, or of its mappings whose /proc/PID/smaps line holds `mapping`."""
    if mapping is None:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0
    total, current = 0.0, ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0]:
            current = line
        elif fields[0] == "Rss:" and mapping in current:
            total += int(fields[1]) / 1024
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint directory or .gguf file (default model)")
    parser.add_argument("--quantization", nargs="+", default=["auto", "none"])
    parser.add_argument("--kv-cache-memory", type=int, default=64 * 2**20)
    args = parser.parse_args()
    from engine import LLM, SamplingParams

    print(f"{'quantization':>12} | {'worker MiB':>10} {'anonymous':>9} {'GGUF mapped':>11}")
    for quantization in args.quantization:
        with LLM(
            model=args.model,
            quantization=quantization,
            kv_cache_memory=args.kv_cache_memory,
            max_model_len=1024,
        ) as llm:
            llm.generate(["Hello"], SamplingParams(max_tokens=8))  # a step has run
            time.sleep(1)
            worker = max(descendants(os.getpid()), key=rss_mib)
            print(
                f"{quantization:>12} | {rss_mib(worker):>10.0f} "
                f"{rss_mib(worker, ' 00:00 0 '):>9.0f} {rss_mib(worker, '.gguf'):>11.1f}"
            )


if __name__ == "__main__":
    main()
