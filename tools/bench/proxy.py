"""What `engine proxy` adds: the same requests sent to an instance directly and through a proxy
in front of it, in one run, side by side.

    python tools/bench/proxy.py --direct http://127.0.0.1:8001 --proxy http://127.0.0.1:8000 \\
        [--api-key KEY] [--requests 200] [--stream-tokens 400]

- a forwarded route (GET /v1/models): latency p50/p99, the proxy's own cost per request;
- a greedy stream: time to first event, gaps between events p50/p99, events/s. Through the
  proxy the request is also prefilled on its prefill instance first (one token), so the first
  event comes later; the gaps show whether relaying holds events back.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import httpx


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def route_latencies(client: httpx.Client, base: str, n: int) -> list[float]:
    client.get(base + "/v1/models").raise_for_status()  # a warm connection
    out = []
    for _ in range(n):
        start = time.perf_counter()
        client.get(base + "/v1/models").raise_for_status()
        out.append(time.perf_counter() - start)
    return out


def stream_timings(
    client: httpx.Client, base: str, model: str, prompt: str, tokens: int
) -> dict[str, float]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    arrivals = []
    start = time.perf_counter()
    with client.stream("POST", base + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return {
        "first_event_ms": (arrivals[0] - start) * 1e3,
        "gap_p50_ms": percentile(gaps, 0.5) * 1e3,
        "gap_p99_ms": percentile(gaps, 0.99) * 1e3,
        "events_per_s": len(arrivals) / (arrivals[-1] - start),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--direct", required=True, help="an instance's URL")
    parser.add_argument("--proxy", required=True, help="a proxy's URL whose decode is --direct")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--stream-tokens", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3, help="streams per side (median kept)")
    parser.add_argument(
        "--prompt-words", type=int, default=8, help="words per prompt (each round's differ)"
    )
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(headers=headers, timeout=120.0) as client:
        model = client.get(args.direct + "/v1/models").json()["data"][0]["id"]
        print(f"{'':26}{'direct':>12}{'proxy':>12}{'proxy/direct':>14}")
        routes = {side: route_latencies(client, url, args.requests) for side, url in _sides(args)}
        for label, q in (("GET /v1/models p50 ms", 0.5), ("GET /v1/models p99 ms", 0.99)):
            _row(label, *(percentile(routes[s], q) * 1e3 for s in ("direct", "proxy")))
        runs: dict[str, list[dict[str, float]]] = {"direct": [], "proxy": []}
        for n in range(args.rounds):  # interleaved, so both sides see the same machine load
            for side, url in _sides(args):
                # A prompt no earlier round has sent: no side finds it in its prefix cache.
                prompt = " ".join(f"{side}{n}w{i}" for i in range(args.prompt_words))
                runs[side].append(stream_timings(client, url, model, prompt, args.stream_tokens))
        for key in ("first_event_ms", "gap_p50_ms", "gap_p99_ms", "events_per_s"):
            medians = [statistics.median(r[key] for r in runs[s]) for s in ("direct", "proxy")]
            _row(f"stream {key}", *medians)


def _sides(args: argparse.Namespace) -> list[tuple[str, str]]:
    return [("direct", args.direct), ("proxy", args.proxy)]


def _row(label: str, direct: float, proxy: float) -> None:
    print(f"{label:26}{direct:12.2f}{proxy:12.2f}{proxy / direct:14.2f}")


if __name__ == "__main__":
    main()
