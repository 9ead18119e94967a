"""Soak: a bounded run of mixed, partly hostile traffic against one server, and what it left.

    python tools/chaos/soak.py --requests 10000 --time-limit 1800  # starts a demo-model server
    python tools/chaos/soak.py --url http://127.0.0.1:8000 --socket /run/.../admin.sock

The mix (fractions are flags): streaming and plain completions, chat (streamed or not), clients
that disconnect mid-stream, slow readers (a chunk, a pause, a chunk), and bad inputs (malformed
JSON, wrong types, out-of-range values, limits exceeded), each of which must get a 4xx. Both the
request count and the time limit bound the run; whichever comes first ends it.

Printed after a warm-up and at the end: each engine process's RSS and open fds (the server and
every actor, from /proc), the server's /dev/shm segments, restarts per actor (admin socket), and
counts over the whole run, warm-up included: sent, ok, 4xx by status, 5xx, lost (a valid request
without a whole 200 answer, not dropped on purpose by its client: a 4xx loses it too; a bad input
answered other than 4xx). The summary checks the targets: RSS growth <= 5 % after warm-up, no
leaked fd or segment, no restart, nothing lost; exit status 0 when all hold.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):  # run as a script: make `engine` and `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.cli.admin_client import send_command
from engine.client.process import stop_process
from engine.client.servers import EngineServer, ServerFailed, start_engine
from tools.chaos.workload import WORDS

# The KV cache is allocated at start but its pages enter RSS only as blocks are first written,
# and the prefix cache keeps using fresh blocks until it has touched them all: a 2 GiB cache
# takes tens of thousands of requests to settle. A cache the warm-up fills (--warmup) makes RSS
# growth after warm-up mean what the target is about (a leak), not the cache filling.
SOAK_KV_CACHE = "64MiB"
RSS_GROWTH_TARGET = 0.05
BAD_BODIES: list[bytes] = [
    b'{"prompt": "x",',  # malformed JSON
    b'{"prompt": "x", "temperature": "hot"}',
    b'{"prompt": "x", "max_tokens": -3}',
    b'{"prompt": "x", "n": 100000}',
    b'{"prompt": "x", "seed": 123456789012345678901234567890}',
    b'{"prompt": "x", "stop": ["s1","s2","s3","s4","s5","s6","s7","s8","s9","s10","s11","s12",'
    b'"s13","s14","s15","s16","s17","s18","s19","s20","s21","s22","s23","s24","s25","s26","s27",'
    b'"s28","s29","s30","s31","s32","s33","s34","s35","s36","s37","s38","s39","s40","s41","s42",'
    b'"s43","s44","s45","s46","s47","s48","s49","s50","s51","s52","s53","s54","s55","s56","s57",'
    b'"s58","s59","s60","s61","s62","s63","s64","s65"]}',
    b'{"messages": [{"role": "wizard", "content": "hi"}]}',
    b'{"prompt": "\xff\xfe"}',  # invalid UTF-8
]


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    disconnected: int = 0  # dropped by the client on purpose
    statuses: Counter[int] = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)


@dataclass(frozen=True)
class Snapshot:
    rss: dict[str, int]  # process name -> bytes
    fds: dict[str, int]
    segments: int
    restarts: dict[str, int]


def start_server(args: argparse.Namespace) -> EngineServer:
    """`python -m engine serve` on a free port, its log in a fresh temporary directory."""
    cmd = ["serve", "--port", "0", *args.server_args]
    if not any(arg.startswith("--kv-cache-memory") for arg in args.server_args):
        cmd += ["--kv-cache-memory", SOAK_KV_CACHE]
    if args.model:
        cmd += ["--model", args.model]
    log_path = Path(tempfile.mkdtemp(prefix="soak-")) / "engine.log"
    try:
        return start_engine(cmd, log_path, timeout=args.start_timeout)
    except ServerFailed as e:
        raise SystemExit(f"soak: {e}") from None


def actors(socket_path: str) -> list[dict[str, Any]]:
    reply = send_command(Path(socket_path), "actors", [], timeout=30)
    if not reply.get("ok"):
        raise RuntimeError(f"admin actors refused: {reply.get('error')}")
    rows: list[dict[str, Any]] = reply["result"]
    return rows


def snapshot(server_pid: int, socket_path: str) -> Snapshot:
    rows = actors(socket_path)
    pids = {"root": server_pid, **{row["name"]: row["pid"] for row in rows if row["pid"]}}
    rss, fds = {}, {}
    for name, pid in pids.items():
        try:
            with open(f"/proc/{pid}/statm") as statm:
                rss[name] = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            fds[name] = len(os.listdir(f"/proc/{pid}/fd"))
        except FileNotFoundError:
            continue  # restarted in between: the restart count says so
    segments = len(server_segments(server_pid))
    restarts = {row["name"]: row["restarts"] for row in rows}
    return Snapshot(rss, fds, segments, restarts)


def server_segments(server_pid: int) -> list[str]:
    """This server's segments (in its run directories), not other runs' on the host; a run
    directory left behind empty counts as one."""
    found = []
    for entry in os.scandir("/dev/shm"):
        if entry.name.startswith(f"engine-{server_pid}-"):
            inside = os.listdir(entry.path) if entry.is_dir(follow_symlinks=False) else []
            found.extend([f"{entry.name}/{name}" for name in inside] or [entry.name])
    return found


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))


def pick_kind(rng: random.Random, args: argparse.Namespace) -> str:
    return rng.choices(
        ["stream", "plain", "chat", "disconnect", "slow", "bad"],
        [args.stream, args.plain, args.chat, args.disconnect, args.slow, args.bad],
    )[0]


async def one_request(
    client: httpx.AsyncClient,
    rng: random.Random,
    args: argparse.Namespace,
    tally: Tally,
    kind: str,
) -> None:
    tally.sent += 1
    max_tokens = rng.randint(4, args.max_tokens)
    if kind == "bad":
        resp = await client.post(
            "/v1/completions",
            content=rng.choice(BAD_BODIES),
            headers={"Content-Type": "application/json"},
        )
        tally.statuses[resp.status_code] += 1
        if not 400 <= resp.status_code < 500:
            tally.lost.append(f"bad input answered {resp.status_code}: {resp.text[:120]}")
        return
    if kind == "chat":
        path = "/v1/chat/completions"
        body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt(rng)}]}
    else:
        path = "/v1/completions"
        body = {"prompt": prompt(rng)}
    body |= {"max_tokens": max_tokens, "temperature": rng.choice([0.0, 0.8])}
    # Chat goes either way; plain never streams; the rest always do.
    body["stream"] = kind in ("stream", "disconnect", "slow") or (
        kind == "chat" and rng.random() < 0.5
    )
    # Every request below is valid: an answer other than a whole 200 (a 4xx too) loses it.
    if not body["stream"]:
        resp = await client.post(path, json=body)
        tally.statuses[resp.status_code] += 1
        if resp.status_code == 200 and resp.json()["choices"][0].get("finish_reason"):
            tally.ok += 1
        else:
            tally.lost.append(f"{path} answered {resp.status_code}: {resp.text[:120]}")
        return
    async with client.stream("POST", path, json=body) as resp:
        tally.statuses[resp.status_code] += 1
        if resp.status_code != 200:
            await resp.aread()
            tally.lost.append(f"{path} stream answered {resp.status_code}: {resp.text[:120]}")
            return
        done = False
        async for line in resp.aiter_lines():
            if kind == "disconnect" and rng.random() < 0.3:
                tally.disconnected += 1
                return  # leaving the block closes the connection mid-stream
            if kind == "slow":
                await asyncio.sleep(rng.uniform(0.05, 0.3))
            if line == "data: [DONE]":
                done = True
        if done:
            tally.ok += 1
        else:
            tally.lost.append(f"{path} stream ended without [DONE]")


async def drive(
    args: argparse.Namespace, url: str, count: int, deadline: float, tally: Tally
) -> None:
    rng = random.Random(args.seed + count)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(args.request_timeout)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout) as client:
        remaining = iter(range(count))

        async def worker() -> None:
            for _ in remaining:
                if time.monotonic() > deadline:
                    return
                kind = pick_kind(rng, args)
                try:
                    await one_request(client, rng, args, tally, kind)
                except (httpx.HTTPError, ValueError, KeyError) as exc:  # an answer unfit to read
                    tally.lost.append(f"a {kind} request: {type(exc).__name__}: {exc!r}")

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))


def growth(before: Snapshot, after: Snapshot) -> dict[str, float]:
    return {
        name: after.rss[name] / before.rss[name] - 1.0
        for name in before.rss
        if name in after.rss and before.restarts.get(name) == after.restarts.get(name)
    }


def report(before: Snapshot, after: Snapshot, tally: Tally, seconds: float) -> dict[str, Any]:
    rss_growth = growth(before, after)
    fds_leaked = {n: after.fds[n] - before.fds[n] for n in before.fds if n in after.fds}
    restarts = {n: after.restarts[n] - before.restarts.get(n, 0) for n in after.restarts}
    summary = {
        "seconds": round(seconds, 1),
        "sent": tally.sent,
        "ok": tally.ok,
        "disconnected_by_client": tally.disconnected,
        "statuses": dict(sorted(tally.statuses.items())),
        "server_errors": tally.server_errors,
        "lost": len(tally.lost),
        "lost_examples": tally.lost[:5],
        "rss_mib": {n: [before.rss[n] >> 20, after.rss.get(n, 0) >> 20] for n in before.rss},
        "rss_growth_max": round(max(rss_growth.values(), default=0.0), 4),
        "fds": {n: [before.fds[n], after.fds.get(n, 0)] for n in before.fds},
        "fds_leaked": sum(max(0, d) for d in fds_leaked.values()),
        "segments": [before.segments, after.segments],
        "restarts": sum(restarts.values()),
    }
    summary["targets_met"] = (
        summary["rss_growth_max"] <= RSS_GROWTH_TARGET
        and summary["fds_leaked"] == 0
        and after.segments <= before.segments
        and summary["restarts"] == 0
        and summary["lost"] == 0
        and summary["server_errors"] == 0
    )
    return summary


def print_report(s: dict[str, Any]) -> None:
    dropped = s["disconnected_by_client"]
    print(f"{s['sent']} requests in {s['seconds']} s: {s['ok']} complete, {dropped} dropped by")
    print(f"their client on purpose; statuses {s['statuses']}")
    print(
        f"{'process':<16} {'RSS MiB warm':>12} {'RSS MiB end':>12} {'fds warm':>9} {'fds end':>8}"
    )
    for name, (rss0, rss1) in s["rss_mib"].items():
        fd0, fd1 = s["fds"].get(name, [0, 0])
        print(f"{name:<16} {rss0:>12} {rss1:>12} {fd0:>9} {fd1:>8}")
    print(f"/dev/shm segments: {s['segments'][0]} -> {s['segments'][1]}")
    checks = [
        (
            f"RSS growth after warm-up {s['rss_growth_max']:.1%}",
            "<= 5 %",
            s["rss_growth_max"] <= RSS_GROWTH_TARGET,
        ),
        (f"fds leaked {s['fds_leaked']}", "0", s["fds_leaked"] == 0),
        (
            f"segments leaked {max(0, s['segments'][1] - s['segments'][0])}",
            "0",
            s["segments"][1] <= s["segments"][0],
        ),
        (f"restarts {s['restarts']}", "0", s["restarts"] == 0),
        (f"lost {s['lost']}, 5xx {s['server_errors']}", "0", s["lost"] == s["server_errors"] == 0),
    ]
    for what, target, met in checks:
        print(f"  {'ok  ' if met else 'MISS'} {what} (target {target})")
    for example in s["lost_examples"]:
        print(f"  lost: {example}")


async def main_async(args: argparse.Namespace) -> int:
    proc = None
    if args.url:
        url, socket_path, server_pid = args.url, args.socket, args.server_pid
    else:
        server = start_server(args)
        proc, url, socket_path = server.proc, server.url, str(server.admin_socket)
        server_pid = proc.pid
    try:
        started = time.monotonic()
        deadline = started + args.time_limit
        warm = min(args.warmup, args.requests)
        tally = Tally()  # over the whole run: a request lost during the warm-up is lost too
        await drive(args, url, warm, deadline, tally)
        before = snapshot(server_pid, socket_path)
        await drive(args, url, args.requests - warm, deadline, tally)
        await asyncio.sleep(args.settle)  # aborts of dropped streams land
        after = snapshot(server_pid, socket_path)
        summary = report(before, after, tally, time.monotonic() - started)
    finally:
        if proc is not None:
            stop_process(proc, 60.0)
    print_report(summary)
    if proc is not None:
        left = len(server_segments(proc.pid))
        print(f"after the server stopped: {left} of its segments left (exit {proc.returncode})")
        summary["segments_after_stop"] = left
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["targets_met"] else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=10000, help="at most this many requests")
    p.add_argument("--time-limit", type=float, default=1800.0, help="at most this many seconds")
    # The default warm-up touches every block of SOAK_KV_CACHE with the default mix, so that the
    # cache's pages are all in RSS before the first snapshot.
    p.add_argument("--warmup", type=int, default=1500, help="requests before the first snapshot")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=24, help="max_tokens drawn from 4..this")
    for kind, share in [
        ("stream", 0.3),
        ("plain", 0.2),
        ("chat", 0.2),
        ("disconnect", 0.1),
        ("slow", 0.1),
        ("bad", 0.1),
    ]:
        p.add_argument(f"--{kind}", type=float, default=share, help=f"share of {kind} requests")
    p.add_argument(
        "--model", default="demo", help="model of the server it starts (default: the demo model)"
    )
    p.add_argument("--server-args", nargs="*", default=[], help="more flags for that server")
    p.add_argument("--url", help="use a running server instead (needs --socket, --server-pid)")
    p.add_argument("--socket", help="the running server's admin socket")
    p.add_argument("--server-pid", type=int, help="the running server's root pid")
    p.add_argument("--api-key", default=os.environ.get("ENGINE_API_KEY"))
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--settle", type=float, default=3.0, help="wait before the last snapshot")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="also print the summary as JSON")
    args = p.parse_args(argv)
    if args.url and not (args.socket and args.server_pid):
        p.error("--url needs --socket and --server-pid (to read the server's processes)")
    if args.requests < 1 or args.concurrency < 1 or args.time_limit <= 0:
        p.error("--requests, --concurrency and --time-limit must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
