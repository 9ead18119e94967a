"""What `--record-trace` costs serving: the same workload against two servers, one recording.

    python tools/bench/trace_overhead.py [--model /path/to/ckpt] --requests 300 --rounds 5

Two servers (same settings; one with `--record-trace`) start side by side; a Poisson workload
(seeded, greedy, EOS ignored: every request decodes exactly --output-len tokens) is replayed
against them in alternating rounds, as fast as --concurrency allows, so drift on a busy machine
hits both alike. Per side: median throughput, median TTFT p50, and CPU seconds the server's
root process (HTTP, gateway, and the trace writer thread) spent per request, read from /proc.
The ratio column is recording / not recording.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.client.servers import ServerFailed, start_engine
from engine.trace.client import ClientOptions, replay
from engine.trace.format import encode_record, parse_lines
from engine.trace.importers import ImportOptions, poisson_workload
from engine.trace.report import replay_figures
from engine.trace.schedule import build_schedule
from engine.trace.synth import PromptSynth


@dataclass
class Side:
    name: str
    proc: subprocess.Popen[str]
    url: str
    throughput: list[float] = field(default_factory=list)
    ttft_p50: list[float] = field(default_factory=list)
    cpu_per_request: list[float] = field(default_factory=list)


def start(name: str, args: argparse.Namespace, work: Path, extra: list[str]) -> Side:
    cmd = [
        "serve",
        "--model",
        args.model,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--device",
        "cpu",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        str(args.concurrency),
        "--max-queued-samples",
        "1024",
        "--kv-cache-memory",
        "64MiB",
        "--admin.socket",
        str(work / f"{name}.sock"),
        *extra,
    ]
    try:
        server = start_engine(cmd, work / f"{name}.log", timeout=300.0)
    except ServerFailed as e:
        raise SystemExit(str(e)) from None
    return Side(name, server.proc, server.url)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        help="checkpoint directory, .gguf file or 'demo' (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    from engine.launch.model_source import model_directory
    from engine.settings.home import default_engine_home

    args.model, _ = model_directory(args.model, default_engine_home())

    work = Path(tempfile.mkdtemp(prefix="trace-overhead-"))
    workload = poisson_workload(
        rate=1000.0,
        num=args.requests,
        input_len=args.input_len,
        output_len=args.output_len,
        options=ImportOptions(synth=PromptSynth(512)),
    )
    entries = parse_lines([encode_record(r) for r in workload.records]).entries
    schedule = build_schedule(entries, speed=float("inf"), default_model=args.model)
    plain = start("plain", args, work, [])
    recording = start("recording", args, work, ["--record-trace", str(work / "trace.jsonl")])
    try:
        for round_number in range(args.rounds):
            order = [plain, recording] if round_number % 2 == 0 else [recording, plain]
            for side in order:
                before = cpu_seconds(side.proc.pid)
                options = ClientOptions(side.url, max_concurrency=args.concurrency)
                results = asyncio.run(replay(schedule, options))
                used = cpu_seconds(side.proc.pid) - before
                figures = replay_figures(results)
                assert figures.failed == 0, f"{side.name}: {figures.failed} requests failed"
                side.throughput.append(figures.output_tokens_per_s)
                side.ttft_p50.append((figures.ttft.p50 or 0.0) * 1000)
                side.cpu_per_request.append(used / len(results) * 1000)
            print(f"round {round_number + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for side in (plain, recording):
            side.proc.terminate()
            side.proc.wait(60)
    lines = (work / "trace.jsonl").read_bytes().count(b"\n")
    print(
        f"{args.requests} requests x {args.rounds} rounds, {args.input_len} in / "
        f"{args.output_len} out tokens, {args.concurrency} in flight; {lines} lines recorded"
    )
    print(f"{'median':32}{'no trace':>12}{'--record-trace':>16}{'ratio':>8}")
    for label, attr in (
        ("output tokens/s", "throughput"),
        ("TTFT p50 (ms)", "ttft_p50"),
        ("root CPU ms per request", "cpu_per_request"),
    ):
        a = statistics.median(getattr(plain, attr))
        b = statistics.median(getattr(recording, attr))
        print(f"{label:32}{a:12.2f}{b:16.2f}{b / a:8.3f}")
    for side in (plain, recording):
        print(
            f"  {side.name} tokens/s per round: " + ", ".join(f"{v:.0f}" for v in side.throughput)
        )


if __name__ == "__main__":
    main()
