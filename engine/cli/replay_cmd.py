"""`python -m engine replay TRACE --url URL [...]`: re-send a trace to an OpenAI-compatible server.

Exit status: 0 every request succeeded (and, with --compare, every deterministic output matched
the recording, where both runs were --deterministic: elsewhere a difference is listed with why it
may happen, not failed); 1 some request failed or mismatched; 2 usage error, unreadable trace, or
a trace a running server is still recording into.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Mapping

import httpx
import msgspec

from engine.trace.client import ClientOptions, ReplayResult, replay
from engine.trace.format import read_trace
from engine.trace.plot import plot_replay
from engine.trace.recorder import being_recorded
from engine.trace.render import render_text
from engine.trace.report import build_report
from engine.trace.schedule import ScheduledRequest, build_schedule


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m engine replay",
        description="Replay a trace (recorded with --record-trace, or imported with "
        "`python -m engine trace import`) against any OpenAI-compatible server.",
    )
    p.add_argument("trace", help="trace file (JSON Lines, engine trace format)")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--speed",
        type=_positive_float,
        default=1.0,
        help="divide inter-arrival times by this (2 = twice as fast; inf = no waiting)",
    )
    p.add_argument(
        "--max-concurrency",
        type=_positive_int,
        default=None,
        help="at most this many requests in flight (later ones wait)",
    )
    p.add_argument(
        "--limit",
        type=_positive_int,
        default=None,
        help="replay only the first N requests (by arrival)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="send every request to this model (default: the recorded one; for "
        "requests without one, the server's first model)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="bearer token (default: env ENGINE_API_KEY or OPENAI_API_KEY)",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="check greedy and seeded outputs against the recording: exact where the recording "
        "and this server both run with --deterministic; elsewhere differences are listed, not "
        "failed",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--plot",
        metavar="OUT.png",
        default=None,
        help="draw latency CDFs and request timelines, replay beside recording",
    )
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=600.0,
        help="seconds one request may take (default 600)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def run_replay(argv: list[str], environ: Mapping[str, str]) -> int:
    args = _parser().parse_args(argv)
    try:
        trace = read_trace(args.trace)
    except OSError as e:
        print(f"engine replay: cannot read {args.trace}: {e.strerror or e}", file=sys.stderr)
        return 2
    if being_recorded(args.trace):
        print(
            f"engine replay: a running server is recording into {args.trace} (--record-trace): "
            "replayed there, the replay would be appended to the trace being replayed; replay a "
            "copy of it",
            file=sys.stderr,
        )
        return 2
    for problem in trace.problems:
        print(f"engine replay: {args.trace} {problem} (skipped)", file=sys.stderr)
    if not trace.entries:
        print(f"engine replay: {args.trace} holds no request to replay", file=sys.stderr)
        return 2
    api_key = args.api_key or environ.get("ENGINE_API_KEY") or environ.get("OPENAI_API_KEY")
    default_model = None
    if args.model is None and any(e.body.get("model") is None for e in trace.entries):
        default_model = _first_model(args.url, api_key)
    schedule = build_schedule(
        trace.entries,
        speed=args.speed,
        limit=args.limit,
        model=args.model,
        default_model=default_model,
    )
    options = ClientOptions(args.url, api_key, args.max_concurrency, args.timeout)
    results = _run_with_progress(schedule, options, show=not args.no_progress)
    report = build_report(
        trace=args.trace,
        url=args.url,
        speed=args.speed,
        max_concurrency=args.max_concurrency,
        schedule=schedule,
        results=results,
        problems=trace.problems,
        compare=args.compare,
        server_deterministic=_says_deterministic(args.url, api_key) if args.compare else None,
    )
    if args.json:
        sys.stdout.write(msgspec.json.encode(report).decode() + "\n")
    else:
        print(render_text(report))
    if args.plot:
        plot_replay(results, args.plot, title=f"{args.trace} → {args.url}", speed=args.speed)
        if not args.json:
            print(f"\nplot written to {args.plot}")
    c = report.comparison
    mismatched = c is not None and bool(c.mismatches) and c.may_differ is None
    return 1 if report.replay.failed or mismatched else 0


def _run_with_progress(
    schedule: list[ScheduledRequest], options: ClientOptions, *, show: bool
) -> list[ReplayResult]:
    from tqdm import tqdm

    with tqdm(
        total=len(schedule), desc="replay", unit="req", file=sys.stderr, disable=not show
    ) as bar:

        def done(result: ReplayResult) -> None:
            bar.update(1)
            if not result.ok:
                bar.set_postfix_str("some failed", refresh=False)

        return asyncio.run(replay(schedule, options, on_done=done))


def _first_model(url: str, api_key: str | None) -> str | None:
    """The server's first model, for requests that name none (imported traces)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=30.0)
        data = resp.json().get("data") or []
        return str(data[0]["id"]) if resp.status_code == 200 and data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _says_deterministic(url: str, api_key: str | None) -> bool | None:
    """Whether the server says it runs batch-invariant kernels (this engine's /version does);
    None when it does not say."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        answer = httpx.get(url.rstrip("/") + "/version", headers=headers, timeout=30.0).json()
    except (httpx.HTTPError, ValueError):
        return None
    found = answer.get("deterministic") if isinstance(answer, dict) else None
    return found if isinstance(found, bool) else None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value
