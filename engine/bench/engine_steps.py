"""The engine's own figures over a load, from its GET /metrics before and after: steps, compute
per step, the gaps between two steps of a running batch, tokens per compute second, actor CPU."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import httpx

# The engine's scheduler reports its figures every 0.2 s while busy (actor CPU is read at the
# scrape): wait this long after a load before reading /metrics, so the figures cover all of it.
METRICS_SETTLE_S = 0.5


@dataclass
class EngineSteps:
    """The engine's own figures over one load: deltas of its /metrics counters (None: the engine
    does not export that metric)."""

    load: str
    wall_s: float
    steps: float | None
    compute_ms_per_step: float | None
    compute_share: float | None  # compute seconds / the load's wall time
    gaps: float | None
    gap_ms: float | None  # mean time between two steps of a running batch
    gap_scheduler_ms: float | None  # the scheduler's part of it
    tokens_per_compute_s: float | None  # output tokens / compute seconds
    actor_cpu_percent: dict[str, float] = field(default_factory=dict)  # of one core


STEPS = "engine:steps_total"
STEP_COMPUTE = "engine:step_compute_seconds_total"
STEP_GAPS = "engine:step_gaps_total"
STEP_GAP_SECONDS = "engine:step_gap_seconds_total"
STEP_GAP_SCHEDULER = "engine:step_gap_scheduler_seconds_total"
ACTOR_CPU = "engine:actor_cpu_seconds_total"
ACTOR_ORDER = ("root", "tokenizer", "scheduler", "worker", "detokenizer")

Counters = dict[tuple[str, str], float]  # (sample name, its actor label or "") -> value


def parse_metrics(text: str) -> Counters:
    """The samples of a Prometheus text exposition, summed over every label but `actor`; {} for
    text that does not parse."""
    from prometheus_client.parser import text_string_to_metric_families

    counters: Counters = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = (sample.name, sample.labels.get("actor", ""))
                counters[key] = counters.get(key, 0.0) + sample.value
    except ValueError:
        return {}
    return counters


def settled_scrape(url: str) -> Counters:
    """The server's /metrics once its scheduler's report caught up; {} when it has none."""
    time.sleep(METRICS_SETTLE_S)
    with contextlib.suppress(httpx.HTTPError):
        reply = httpx.get(url + "/metrics", timeout=30.0)
        if reply.status_code == 200:
            return parse_metrics(reply.text)
    return {}


def engine_steps(
    load: str, before: Counters, after: Counters, wall_s: float, output_tokens: int
) -> EngineSteps:
    """The engine's step figures over a load from its counters before and after it."""

    def delta(name: str, actor: str = "") -> float | None:
        if (name, actor) not in after:
            return None
        return after[name, actor] - before.get((name, actor), 0.0)  # absent before: it was 0

    steps, compute = delta(STEPS), delta(STEP_COMPUTE)
    gaps, gap_s, scheduler_s = delta(STEP_GAPS), delta(STEP_GAP_SECONDS), delta(STEP_GAP_SCHEDULER)
    actors = sorted(
        (actor for name, actor in after if name == ACTOR_CPU),
        key=lambda a: (_actor_rank(a.rstrip("0123456789")), a),  # worker0 with the workers
    )
    return EngineSteps(
        load=load,
        wall_s=wall_s,
        steps=steps,
        compute_ms_per_step=_per(compute, steps, 1000.0),
        compute_share=_per(compute, wall_s),
        gaps=gaps,
        gap_ms=_per(gap_s, gaps, 1000.0),
        gap_scheduler_ms=_per(scheduler_s, gaps, 1000.0),
        tokens_per_compute_s=_per(float(output_tokens), compute),
        actor_cpu_percent={
            a: 100.0 * seconds / wall_s
            for a in actors
            if (seconds := delta(ACTOR_CPU, a)) is not None and wall_s > 0
        },
    )


def _actor_rank(kind: str) -> int:
    return ACTOR_ORDER.index(kind) if kind in ACTOR_ORDER else len(ACTOR_ORDER)


def _per(top: float | None, bottom: float | None, scale: float = 1.0) -> float | None:
    return None if top is None or not bottom else top / bottom * scale


# (header, EngineSteps field, format)
STEP_COLUMNS = (
    ("steps", "steps", "{:.0f}"),
    ("ms/step", "compute_ms_per_step", "{:.1f}"),
    ("busy", "compute_share", "{:.0%}"),
    ("gaps", "gaps", "{:.0f}"),
    ("gap ms", "gap_ms", "{:.2f}"),
    ("sched ms", "gap_scheduler_ms", "{:.2f}"),
    ("tok/s", "tokens_per_compute_s", "{:.1f}"),
)


def render_steps(steps: list[EngineSteps]) -> str:
    """One line per load of the engine's own figures."""
    widths = [12] + [10] * len(STEP_COLUMNS)
    lines = [
        "engine, from GET /metrics before and after each load: steps, compute ms per step, busy ="
        " compute / the load's time,",
        "gaps between two steps of a running batch (mean ms, the scheduler's part), tok/s = output"
        " tokens / compute seconds, actor CPU in % of one core",
        "",
        table_line(["load", *(h for h, *_ in STEP_COLUMNS)], widths, 1) + "  actor CPU %",
    ]
    for s in steps:
        cells = [table_cell(getattr(s, name), fmt) for _, name, fmt in STEP_COLUMNS]
        cpu = ", ".join(f"{a} {p:.0f}" for a, p in s.actor_cpu_percent.items()) or "—"
        lines.append(table_line([s.load, *cells], widths, 1) + f"  {cpu}")
    return "\n".join(lines)


def table_cell(value: float | None, fmt: str) -> str:
    return "—" if value is None else fmt.format(value)


def table_line(cells: list[str], widths: list[int], left: int = 3) -> str:
    """The first `left` cells left-aligned, the others right-aligned."""
    return "".join(
        c.ljust(w) if i < left else c.rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    )
