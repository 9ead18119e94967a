"""What a served run leaves behind when it ends (RequestRun.finish): the per-request histograms
of the server's metrics and, with --enable-log-requests, one log line."""

from __future__ import annotations

import logging
from typing import Protocol

from engine.http.metrics import ModelMetrics
from engine.http.openai.bodies import ChoiceState
from engine.http.openai.parsing import OpenAIRequest
from engine.http.openai.protocol import Usage
from engine.messages.scheduling import FirstScheduled

log = logging.getLogger("engine.requests")


class FinishedRun(Protocol):
    """What of a RequestRun (runs.py) its end reports."""

    api: OpenAIRequest
    key: str  # its X-Request-Id
    endpoint: str
    status: int
    outcome: str
    arrival: float
    first_token_at: float | None
    scheduling: dict[int, FirstScheduled]

    @property
    def choices(self) -> list[ChoiceState]: ...


def observe_finished(metrics: ModelMetrics, run: FinishedRun, now: float, usage: Usage) -> None:
    """The per-request histograms of a request that was served (not refused)."""
    model = metrics.model_name
    generated = usage.completion_tokens
    metrics.request_prompt_tokens.labels(model).observe(usage.prompt_tokens)
    metrics.request_generation_tokens.labels(model).observe(generated)
    for choice in run.choices:
        if choice.finish_reason is not None:
            metrics.request_success.labels(model, choice.finish_reason).inc()
    if run.outcome == "success":
        metrics.e2e.labels(model).observe(now - run.arrival)
    for scheduling in run.scheduling.values():
        metrics.queue_time.labels(model).observe(scheduling.queue_s)
        metrics.prefill_time.labels(model).observe(scheduling.prefill_s)
    if run.first_token_at is not None:
        decode = now - run.first_token_at
        metrics.decode_time.labels(model).observe(decode)
        later_tokens = generated - run.api.num_choices
        if later_tokens > 0:
            metrics.tpot.labels(model).observe(decode / later_tokens)


def log_request(run: FinishedRun, now: float, usage: Usage, limit: int | None) -> None:
    """One line: id, prompt length, parameters, outcome, timings; the prompt cut at `limit`
    characters (server.max_log_len; None: whole)."""
    p = run.api
    prompt = _prompt_text(run)
    if limit is not None and len(prompt) > limit:
        prompt = prompt[:limit] + "..."
    ttft = "-" if run.first_token_at is None else f"{run.first_token_at - run.arrival:.3f}s"
    params = p.params
    log.info(
        "request %s: %s status=%d outcome=%s prompt_tokens=%d completion_tokens=%d "
        "ttft=%s e2e=%.3fs params=(n=%d max_tokens=%s temperature=%g top_p=%g top_k=%d "
        "seed=%s stop=%r) prompt=%r",
        run.key,
        run.endpoint,
        run.status,
        run.outcome,
        usage.prompt_tokens,
        usage.completion_tokens,
        ttft,
        now - run.arrival,
        params.n,
        params.max_tokens,
        params.temperature,
        params.top_p,
        params.top_k,
        params.seed,
        params.stop,
        prompt,
    )


def _prompt_text(run: FinishedRun) -> str:
    texts = []
    for request in run.api.requests:
        if request.messages is not None:
            texts.append("\n".join(f"{m.role}: {m.content}" for m in request.messages))
        else:
            texts.append(
                str(request.prompt if request.prompt is not None else request.prompt_token_ids)
            )
    return " | ".join(texts)
