"""llama-server beside tools/bench/speculative.py: the same chat prompts on the same GGUF file,
one request at a time, on two servers side by side (an idle one costs no CPU): one plain, one
with `--spec-type ngram-simple` (llama.cpp's prompt-lookup mode), alternating which goes first.
The decode rate is llama-server's own `timings.predicted_per_second`; its draft counts come from
the same `timings` (draft_n, draft_n_accepted)."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from engine.client.process import free_port
from engine.client.servers import http_server
from tools.peers import llamacpp_peer


def spec_args(draft_max: int) -> dict[str, list[str]]:
    """Each server's extra arguments, by name."""
    return {
        "plain": [],
        "ngram": ["--spec-type", "ngram-simple", "--spec-draft-n-max", str(draft_max)],
    }


def chat(url: str, text: str, max_tokens: int) -> dict[str, Any]:
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": text}],
            "temperature": 0.0,
            "max_tokens": max_tokens,
            "seed": 0,
        }
    ).encode()
    request = urllib.request.Request(
        url + "/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def bench_llama_server(
    args: argparse.Namespace, prompts: dict[str, tuple[bool, str]], gguf: str
) -> None:
    logs = Path(tempfile.mkdtemp(prefix="bench-speculative-llama-"))
    rates: dict[str, dict[str, list[float]]] = {p: {"plain": [], "ngram": []} for p in prompts}
    drafts = {"n": 0, "accepted": 0}
    with contextlib.ExitStack() as stack:
        urls = {}
        for name, extra in spec_args(max(args.ngram_tokens)).items():
            cmd = [
                str(llamacpp_peer.binaries() / "llama-server"),
                "-m",
                gguf,
                "-t",
                str(llamacpp_peer.THREADS),
                "-np",
                "1",
                "-c",
                "4096",
                "--host",
                "127.0.0.1",
                "--port",
                str(free_port()),
                *extra,
            ]
            urls[name] = stack.enter_context(
                http_server(
                    cmd,
                    f"llama-server-{name}",
                    logs / f"{name}.log",
                    "/health",
                    300.0,
                    llamacpp_peer.peer_environment(),
                    30.0,
                )
            )
        for round_index in range(args.rounds + 1):
            order = ["plain", "ngram"] if round_index % 2 == 0 else ["ngram", "plain"]
            for prompt, (_, text) in prompts.items():
                for name in order:
                    timings = chat(urls[name], text, args.max_tokens).get("timings", {})
                    if round_index:
                        rates[prompt][name].append(float(timings.get("predicted_per_second", 0)))
                        if name == "ngram":
                            drafts["n"] += int(timings.get("draft_n", 0))
                            drafts["accepted"] += int(timings.get("draft_n_accepted", 0))
    print(f"llama-server ngram-simple: draft tokens {drafts['n']}, accepted {drafts['accepted']}")
    print(f"{'prompt':10} {'llama plain':>12} {'llama ngram':>12} {'ratio':>7}  per-round ratios")
    for prompt, by_server in rates.items():
        plain, ngram = by_server["plain"], by_server["ngram"]
        ratios = [n / p for n, p in zip(ngram, plain, strict=True) if p]
        print(
            f"{prompt:10} {statistics.median(plain):12.1f} {statistics.median(ngram):12.1f} "
            f"{statistics.median(ratios) if ratios else 0.0:7.2f}  "
            + " ".join(f"{r:.2f}" for r in ratios)
        )
