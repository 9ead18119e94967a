"""`python -m engine proxy` for end-to-end tests: started on port 0 in front of given instance
URLs, its ready line read, stopped (SIGTERM) and its exit status checked on leaving."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.harness import API_KEY, Server, read_line_starting, spawn_engine, stop_process

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@dataclass
class Proxy:
    proc: subprocess.Popen[str]
    url: str
    log_path: Path

    def http(self, **kw: Any) -> httpx.Client:
        kw.setdefault("timeout", 60.0)
        return httpx.Client(base_url=self.url, headers=AUTH, **kw)

    def metric(self, name: str, /, **labels: str) -> float:
        return metric(self.url, name, **labels)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def proxied(
    log_dir: Path, prefill: list[str], decode: list[str], *flags: str, name: str = "proxy"
) -> Iterator[Proxy]:
    log_path = log_dir / f"{name}.log"
    argv = ["--prefill", *prefill, "--decode", *decode, "--port", "0", *flags]
    proc = spawn_engine(["proxy", *argv], log_path)
    try:
        line = read_line_starting(proc, "engine ready:", 60.0)
        yield Proxy(proc, line.split()[2], log_path)
    finally:
        status = stop_process(proc, 30.0)
    assert status == 0, log_path.read_text(errors="replace")


def metric(base_url: str, name: str, /, **labels: str) -> float:
    """The sum of `name`'s samples at `base_url`/metrics whose labels include `labels`."""
    text = httpx.get(base_url + "/metrics", headers=AUTH, timeout=30.0).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def direct(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    with server.http() as http:
        return http.post(path, json=body)


def completion_fields(answer: dict[str, Any]) -> dict[str, Any]:
    """What must agree between two answers to one request: ids, times and prefix-cache hits
    differ, and a prompt partly read from the prefix cache moves logprobs in the last digits."""
    usage = {k: v for k, v in answer["usage"].items() if k != "prompt_tokens_details"}
    return {"choices": rounded(answer["choices"]), "usage": usage}


def rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, list):
        return [rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    return value
