"""A serving benchmark's figures per server and load (throughput, TTFT, TPOT, ITL), the ratios
of the first server (the engine) to each other one, and the table that shows them."""

from __future__ import annotations

from dataclasses import dataclass

from engine.bench.engine_steps import EngineSteps, render_steps, table_cell, table_line
from engine.trace.client import ReplayResult
from engine.trace.report import percentile, replay_figures

SERVER_NAMES = {"engine": "engine", "vllm": "vLLM", "llamacpp": "llama.cpp"}


@dataclass
class Figures:
    server: str
    load: str
    requests: int
    ok: int
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    first_error: str | None


def summarize(server: str, load: str, results: list[ReplayResult]) -> Figures:
    run = replay_figures(results)
    ok = [r for r in results if r.ok]
    tpots = [
        (r.e2e - r.ttft) / (r.completion_tokens - 1)
        for r in ok
        if r.ttft is not None and r.completion_tokens > 1
    ]
    itls = [gap for r in ok for gap in r.itls]
    failed = next((r for r in results if not r.ok), None)
    return Figures(
        server=server,
        load=load,
        requests=run.requests,
        ok=run.ok,
        requests_per_s=run.requests_per_s,
        output_tokens_per_s=run.output_tokens_per_s,
        ttft_p50_ms=_ms(run.ttft.p50),
        ttft_p99_ms=_ms(run.ttft.p99),
        tpot_p50_ms=_ms(percentile(tpots, 50)),
        tpot_p99_ms=_ms(percentile(tpots, 99)),
        itl_p50_ms=_ms(percentile(itls, 50)),
        itl_p99_ms=_ms(percentile(itls, 99)),
        first_error=failed.error if failed else None,
    )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


# (header, Figures field, format, True when higher is better)
COLUMNS = (
    ("req/s", "requests_per_s", "{:.2f}", True),
    ("out tok/s", "output_tokens_per_s", "{:.1f}", True),
    ("TTFT p50", "ttft_p50_ms", "{:.1f}", False),
    ("TTFT p99", "ttft_p99_ms", "{:.1f}", False),
    ("TPOT p50", "tpot_p50_ms", "{:.1f}", False),
    ("TPOT p99", "tpot_p99_ms", "{:.1f}", False),
    ("ITL p50", "itl_p50_ms", "{:.1f}", False),
    ("ITL p99", "itl_p99_ms", "{:.1f}", False),
)


def ratios(ours: Figures, peer: Figures) -> dict[str, float | None]:
    """Engine / peer for throughput, peer / engine for latency: > 1 = the engine is better."""
    out: dict[str, float | None] = {}
    for _, name, _, higher_better in COLUMNS:
        a, b = getattr(ours, name), getattr(peer, name)
        top, bottom = (a, b) if higher_better else (b, a)
        out[name] = top / bottom if top is not None and bottom else None
    return out


def ratio_pairs(figures: list[Figures]) -> list[tuple[Figures, Figures]]:
    """(first server's figures, another server's) for each load and each other server: the first
    server (the engine) is what every ratio row measures the others against."""
    first = _name(figures[0]) if figures else ""
    ours = {f.load: f for f in figures if _name(f) == first}
    return [(ours[f.load], f) for f in figures if _name(f) != first and f.load in ours]


ROUND = " #"  # between a load's label and its round's number: "1 stream #2"
RANGED = (("out tok/s", "output_tokens_per_s"), ("TPOT p50", "tpot_p50_ms"))


def round_label(label: str, number: int, rounds: int) -> str:
    """A load's label in round `number` of `rounds` (as it was when there is one round)."""
    return label if rounds == 1 else f"{label}{ROUND}{number}"


def round_ranges(figures: list[Figures]) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Per peer and load (its round taken off the label), each RANGED ratio's [lowest, highest]
    over the rounds: {"llama.cpp": {"1 stream": {"output_tokens_per_s": [1.3, 1.5], ...}}}."""
    seen: dict[str, dict[str, dict[str, list[float]]]] = {}
    for ours, peer in ratio_pairs(figures):
        if ROUND not in ours.load:
            continue
        load = ours.load.rsplit(ROUND, 1)[0]
        by_name = seen.setdefault(_name(peer), {}).setdefault(load, {})
        for name, value in ratios(ours, peer).items():
            if value is not None and name in dict(RANGED).values():
                by_name.setdefault(name, []).append(value)
    return {
        peer: {
            load: {n: [min(v), max(v)] for n, v in names.items()} for load, names in loads.items()
        }
        for peer, loads in seen.items()
    }


def _range_lines(figures: list[Figures]) -> list[str]:
    lines = []
    for peer, loads in round_ranges(figures).items():
        for load, names in loads.items():
            spans = [
                f"{header} {names[field][0]:.2f}-{names[field][1]:.2f}x"
                for header, field in RANGED
                if field in names
            ]
            lines.append(f"ratio vs {peer}, {load}, over the rounds: {', '.join(spans)}")
    return lines


def render(describe: str, figures: list[Figures], steps: list[EngineSteps] | None = None) -> str:
    names = list(dict.fromkeys(_name(f) for f in figures))
    pairs = ratio_pairs(figures)
    labels = [*names, *(f"ratio vs {n}" for n in names[1:])]
    widths = [max(8, *(len(n) + 2 for n in labels)), 12, 8] + [10] * len(COLUMNS)
    head = ["server", "load", "ok", *(h for h, *_ in COLUMNS)]
    units = "latencies in ms"
    if len(names) > 1:
        units += (
            f"; 'ratio vs PEER' rows: throughput {names[0]} / PEER, latency PEER / "
            f"{names[0]} (> 1 = {names[0]} better)"
        )
    lines = [describe, units, "", table_line(head, widths)]
    for load in dict.fromkeys(f.load for f in figures):
        for f in figures:
            if f.load == load:
                cells = [table_cell(getattr(f, name), fmt) for _, name, fmt, _ in COLUMNS]
                lines.append(table_line([_name(f), load, f"{f.ok}/{f.requests}", *cells], widths))
        for ours, peer in pairs:
            if ours.load == load:
                cells = [table_cell(r, "{:.2f}x") for r in ratios(ours, peer).values()]
                lines.append(table_line([f"ratio vs {_name(peer)}", load, "", *cells], widths))
    for f in figures:
        if f.first_error:
            lines.append(
                f"{_name(f)} at {f.load}: {f.requests - f.ok} failed, first: {f.first_error}"
            )
    ranges = _range_lines(figures)
    if ranges:
        lines += ["", *ranges]
    if steps:
        lines += ["", render_steps(steps)]
    return "\n".join(lines)


def _name(figures: Figures) -> str:
    """How a row is labelled: vLLM's or ours; a setup of ours by its own name (bench_pd)."""
    return SERVER_NAMES.get(figures.server, figures.server)
