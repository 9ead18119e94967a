"""What `--otlp-traces-endpoint` costs serving: the same workload against two servers, one
exporting a span per request to an OTLP/HTTP sink in this process.

    python tools/bench/otel_overhead.py [--model demo] --requests 300 --rounds 5

As tools/bench/trace_overhead.py (whose server start, workload and CPU reading it uses): two
servers with the same settings start side by side and a seeded Poisson workload (greedy, EOS
ignored) is replayed against them in alternating rounds, so drift on a busy machine hits both
alike. Per side: median throughput, TTFT p50, and the CPU seconds the server's root process
(HTTP, gateway, span building and the SDK's export thread) spent per request. The sink answers
every export at once and counts the spans' bytes; it does not decode them.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.trace.client import ClientOptions, replay
from engine.trace.format import encode_record, parse_lines
from engine.trace.importers import ImportOptions, poisson_workload
from engine.trace.report import replay_figures
from engine.trace.schedule import build_schedule
from engine.trace.synth import PromptSynth
from tools.bench.trace_overhead import Side, cpu_seconds, start


@contextmanager
def otlp_sink() -> Iterator[tuple[str, dict[str, int]]]:
    """A collector that accepts every export: its URL and {"posts": n, "bytes": n}."""
    seen = {"posts": 0, "bytes": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            size = int(self.headers.get("Content-Length", "0"))
            self.rfile.read(size)
            seen["posts"] += 1
            seen["bytes"] += size
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def run_rounds(sides: list[Side], args: argparse.Namespace, schedule: Any) -> None:
    for round_number in range(args.rounds):
        order = sides if round_number % 2 == 0 else sides[::-1]
        for side in order:
            options = ClientOptions(side.url, max_concurrency=args.concurrency)
            before = cpu_seconds(side.proc.pid)
            results = asyncio.run(replay(schedule, options))
            used = cpu_seconds(side.proc.pid) - before
            figures = replay_figures(results)
            assert figures.failed == 0, f"{side.name}: {figures.failed} requests failed"
            side.throughput.append(figures.output_tokens_per_s)
            side.ttft_p50.append((figures.ttft.p50 or 0.0) * 1000)
            side.cpu_per_request.append(used / len(results) * 1000)
        print(f"round {round_number + 1}/{args.rounds} done", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo", help="checkpoint directory, .gguf or 'demo'")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    from engine.launch.model_source import model_directory
    from engine.settings.home import default_engine_home

    args.model, _ = model_directory(args.model, default_engine_home())
    work = Path(tempfile.mkdtemp(prefix="otel-overhead-"))
    workload = poisson_workload(
        rate=1000.0,
        num=args.requests,
        input_len=args.input_len,
        output_len=args.output_len,
        options=ImportOptions(synth=PromptSynth(512)),
    )
    entries = parse_lines([encode_record(r) for r in workload.records]).entries
    schedule = build_schedule(entries, speed=float("inf"), default_model=args.model)
    with otlp_sink() as (url, seen):
        plain = start("plain", args, work, [])
        traced = start("traced", args, work, ["--otlp-traces-endpoint", url])
        try:
            run_rounds([plain, traced], args, schedule)
        finally:
            for side in (plain, traced):
                side.proc.terminate()
                side.proc.wait(60)
    report(args, plain, traced, seen)


def report(args: argparse.Namespace, plain: Side, traced: Side, seen: dict[str, int]) -> None:
    print(
        f"{args.requests} requests x {args.rounds} rounds, {args.input_len} in / "
        f"{args.output_len} out tokens, {args.concurrency} in flight; the sink got "
        f"{seen['posts']} exports, {seen['bytes']} bytes"
    )
    print(f"{'median':32}{'no tracing':>12}{'--otlp-traces':>16}{'ratio':>8}")
    for label, name in (
        ("output tokens/s", "throughput"),
        ("TTFT p50 (ms)", "ttft_p50"),
        ("root CPU ms per request", "cpu_per_request"),
    ):
        a = statistics.median(getattr(plain, name))
        b = statistics.median(getattr(traced, name))
        print(f"{label:32}{a:12.2f}{b:16.2f}{b / a:8.3f}")
    for side in (plain, traced):
        values = ", ".join(f"{v:.2f}" for v in side.cpu_per_request)
        print(f"  {side.name} root CPU ms per request by round: {values}")


if __name__ == "__main__":
    main()
