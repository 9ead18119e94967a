"""Chaos: a streaming workload against a running server while random actors are SIGKILLed or
SIGSTOPped (tools/chaos/faults.py), then the same workload undisturbed; every stream of the first
run must equal its twin in the second.

    python -m engine --runtime.restart_intensity 100 --runtime.restart_period 10 &
    python tools/chaos/run.py --requests 200 --concurrency 16 --faults 24 --kinds kill,hang,pause

    python tools/chaos/run.py --launch single --model /tmp/l28 --kinds kill,hang,pause
    python tools/chaos/run.py --launch pd --kinds kill,hang,pause     # prefill + decode + proxy

--launch starts the server(s) itself (tools/chaos/servers.py) and stops them at the end: `pd` is
a prefill and a decode instance behind `python -m engine proxy`, the workload goes through the
proxy and faults hit the actors of both instances, kv_transfer ones included.

The workload: N streaming completions, half greedy and half seeded sampling, EOS ignored (every
request runs to its own max_tokens), half with a stop string that never matches (so the
detokenizer holds text back all along). Victims are drawn from the running actors that the admin
socket lists, at random gaps, while the workload runs.

Printed: requests, completed, lost (no normal end: an error, a cut stream), mismatched (text or
token sequence differs from the undisturbed run), duplicated tokens (tokens beyond the
undisturbed count), faults by kind and victim, hung actors never replaced, restarts by actor,
and recovery time per fault: from the fault until every stream then in flight has received its
next token (p50 / p99 over faults, and by kind of fault and actor).

Equality with the undisturbed run holds only where outputs do not depend on batching: the real
default model's do, and it mismatches between two undisturbed runs too (`--faults 0`
shows that baseline), so serve it with --deterministic (batch-invariant kernels) to judge
faults by mismatches.

The server's restart intensity (runtime.restart_intensity restarts within
runtime.restart_period seconds, default 5 in 60 s) must allow the fault rate, as above (--launch
sets it); the backoff between restarts grows with restarts inside the period, so a short period
keeps the restarts quick. Exit status 0 when nothing was lost, mismatched or duplicated and every
hung actor was replaced.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a script: make `engine` and `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.chaos.faults import (
    KINDS,
    Fault,
    FaultPlan,
    all_actors,
    all_running,
    faults_by,
    inject_faults,
    still_stopped,
)
from tools.chaos.report import (
    compare,
    longest_stall,
    percentile,
    print_summary,
    recovery_times,
    restarts_by_actor,
)
from tools.chaos.servers import launched
from tools.chaos.workload import Job, Stream, make_workload, run_workload


async def chaos_phase(
    args: argparse.Namespace, jobs: list[Job], plan: FaultPlan
) -> tuple[list[Stream], list[Fault]]:
    done = asyncio.Event()
    injector = asyncio.ensure_future(inject_faults(plan, random.Random(args.seed + 1), done))
    try:
        streams = await run_workload(args, jobs)
    finally:
        done.set()
    return streams, await injector


async def main_async(args: argparse.Namespace) -> int:
    if not args.launch:
        sockets = {"engine": args.socket[0]} if args.socket and len(args.socket) == 1 else {}
        if args.socket and len(args.socket) > 1:
            sockets = {f"i{n}": path for n, path in enumerate(args.socket)}
        return await run_chaos(args, sockets or {"engine": None})
    logs = Path(args.logs or tempfile.mkdtemp(prefix=f"chaos-{args.launch}-"))
    logs.mkdir(parents=True, exist_ok=True)
    extra = [*shlex.split(args.engine_args)]
    if args.heartbeat_timeout:
        extra += ["--runtime.heartbeat_timeout", str(args.heartbeat_timeout)]
    print(f"chaos: starting {args.launch} (logs in {logs})", flush=True)
    proxy_extra = tuple(shlex.split(args.proxy_args))
    with launched(args.launch, args.model, extra, logs, args.start_timeout, proxy_extra) as servers:
        args.url = servers.url
        # As a deployed server, idle a while after its start: its spare processes start once
        # it is quiet (engine/runtime/spares.py), and a fault before that measures a cold start.
        await asyncio.sleep(args.warm_up)
        return await run_chaos(args, servers.sockets)


async def run_chaos(args: argparse.Namespace, sockets: dict[str, str | None]) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=30) as client:
        models = (await client.get("/v1/models")).raise_for_status().json()
    model = models["data"][0]["id"]
    jobs = make_workload(args, model)
    print(f"chaos: {len(jobs)} requests, {args.concurrency} at a time, on {model} at {args.url}")
    plan = fault_plan(args, sockets)
    before = await all_actors(plan)
    started = time.monotonic()
    chaos, faults = await chaos_phase(args, jobs, plan)
    chaos_s = time.monotonic() - started
    await asyncio.sleep(args.settle)  # the last restart may still be under way
    never_replaced = await still_stopped(plan, args.hang_deadline)
    if not await all_running(plan, args.hang_deadline):
        print("warning: some actors were still not running when the undisturbed run began")
    after = await all_actors(plan)
    print("reference: the same workload, undisturbed", flush=True)
    started = time.monotonic()
    reference = await run_workload(args, jobs)
    reference_s = time.monotonic() - started

    summary = compare(chaos, reference)
    recovered = recovery_times(chaos, faults)
    recoveries = [seconds for _, seconds in recovered]
    by_victim: dict[str, list[float]] = {}
    for name, seconds in recovered:
        by_victim.setdefault(name, []).append(seconds)
    summary.update(
        recovery_p50_by_actor_s={name: percentile(v, 50) for name, v in sorted(by_victim.items())},
        recovery_p99_by_actor_s={name: percentile(v, 99) for name, v in sorted(by_victim.items())},
        faults=len(faults),
        faults_by_kind=dict(Counter(fault.kind for fault in faults)),
        faults_by_actor=faults_by(faults),
        hung_never_replaced=[f"{f.name} (pid {f.pid})" for f in never_replaced],
        restarts_by_actor=dict(restarts_by_actor(before, after)),
        recovery_p50_s=percentile(recoveries, 50) if recoveries else None,
        recovery_p99_s=percentile(recoveries, 99) if recoveries else None,
        recovery_max_s=max(recoveries, default=None),
        longest_stall_s=longest_stall(chaos),
        chaos_phase_s=chaos_s,
        reference_phase_s=reference_s,
    )
    print_summary(summary)
    if args.json:
        print(json.dumps(summary))
    bad = summary["lost"] or summary["mismatched"] or summary["duplicated_tokens"]
    return 1 if bad or summary["reference_failures"] or never_replaced else 0


def fault_plan(args: argparse.Namespace, sockets: dict[str, str | None]) -> FaultPlan:
    low, _, high = args.pause.partition(":")
    return FaultPlan(
        kinds=tuple(args.kinds.split(",")),
        count=args.faults,
        min_gap=args.min_gap,
        max_gap=args.max_gap,
        pause_s=(float(low), float(high or low)),
        targets=frozenset(args.actors.split(",")) if args.actors else None,
        sockets=sockets,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--api-key", default=os.environ.get("ENGINE_API_KEY"), help="if it wants one")
    p.add_argument(
        "--socket",
        action="append",
        help="its admin socket (default: the newest live one); repeat for several instances",
    )
    p.add_argument("--launch", choices=("single", "pd"), help="start the server(s) here")
    p.add_argument("--model", help="with --launch: the model (default: the engine's default)")
    p.add_argument("--engine-args", default="", help="with --launch: more flags for instances")
    p.add_argument("--proxy-args", default="", help="with --launch pd: more flags for the proxy")
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=0.0,
        help="with --launch: the instances' runtime.heartbeat_timeout; 0 = the "
        "engine's default (stopped actors: runtime.stopped_timeout)",
    )
    p.add_argument("--start-timeout", type=float, default=600.0, help="with --launch")
    p.add_argument(
        "--warm-up",
        type=float,
        default=15.0,
        help="with --launch: seconds the servers idle before the workload",
    )
    p.add_argument("--logs", help="with --launch: where the servers' logs go (default: a temp dir)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16, help="streams in flight at once")
    p.add_argument("--min-tokens", type=int, default=64, help="max_tokens is drawn from here..")
    p.add_argument("--max-tokens", type=int, default=256, help="..to here")
    p.add_argument("--faults", "--kills", type=int, default=20, help="at most this many faults")
    p.add_argument("--kinds", default="kill", help=f"comma-separated fault kinds of {KINDS}")
    p.add_argument(
        "--pause", default="0.1:0.3", help="a pause lasts FROM:TO seconds (< stopped_timeout)"
    )
    p.add_argument("--min-gap", type=float, default=0.5, help="seconds between faults, from..")
    p.add_argument("--max-gap", type=float, default=2.5, help="..to")
    p.add_argument("--actors", help="comma-separated actor names to hit (default: any)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--settle", type=float, default=3.0, help="wait after the chaos phase")
    p.add_argument(
        "--hang-deadline",
        type=float,
        default=60.0,
        help="seconds after the chaos phase a hung actor may stay stopped before it "
        "counts as never replaced",
    )
    p.add_argument("--json", action="store_true", help="also print the summary as JSON")
    args = p.parse_args(argv)
    if not 0 < args.min_tokens <= args.max_tokens:
        p.error(f"need 0 < --min-tokens <= --max-tokens, got {args.min_tokens}, {args.max_tokens}")
    if not 0 <= args.min_gap <= args.max_gap:
        p.error(f"need 0 <= --min-gap <= --max-gap, got {args.min_gap}, {args.max_gap}")
    if not args.kinds or not set(args.kinds.split(",")) <= set(KINDS):
        p.error(f"--kinds takes a comma-separated list of {KINDS}, got {args.kinds!r}")
    if args.requests < 1 or args.concurrency < 1:
        p.error("--requests and --concurrency must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
