"""The scheduler's cost per step with 1, 10 and 100 tenants (issue 49), beside no tenants.

The scheduler alone, no model: each step is planned, every sampled chunk gets token 1, and the
result is applied; finished requests are replaced, so the queue stays full (the waiting list
as long as the running one). The figure is the time of `schedule()` + `update()`, per step,
median and p90 over the measured steps; rounds alternate the tenant counts so that a shared
machine's drift falls on all of them alike.

    .venv/bin/python tools/bench/tenant_schedule.py --tenants 0 1 10 100 --rounds 3
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time

from engine.messages.params import SamplingParams
from engine.messages.scheduling import SubmitRequest, TenantTag
from engine.messages.steps import StepResult
from engine.scheduler import Scheduler
from engine.scheduler.config import SchedulerConfig


def _submit(
    number: int, tenants: list[TenantTag | None], rng: random.Random, args: argparse.Namespace
) -> SubmitRequest:
    prompt = [rng.randrange(10, 30000) for _ in range(args.prompt_len)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    tenant = tenants[number % len(tenants)]
    return SubmitRequest(f"r{number}", 0, prompt, params, number, tenant=tenant)


def step_seconds(num_tenants: int, args: argparse.Namespace) -> list[float]:
    """Seconds of each measured step with `num_tenants` tenants (0: requests carry none)."""
    config = SchedulerConfig(
        num_blocks=args.num_blocks,
        block_size=16,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.prompt_len + args.output_len,
    )
    scheduler = Scheduler(config)
    tenants: list[TenantTag | None] = [
        TenantTag(f"t{i}", 1.0 + i % 3, f"t{i}") for i in range(num_tenants)
    ] or [None]
    rng = random.Random(7)
    numbers = itertools.count()
    for _ in range(2 * args.max_num_seqs):
        scheduler.add(_submit(next(numbers), tenants, rng, args))
    times: list[float] = []
    for step in range(args.warmup + args.steps):
        began = time.perf_counter()
        plan = scheduler.schedule()
        assert plan is not None and plan.chunks, "the queue ran dry"
        sampled = [chunk.seq_id for chunk in plan.chunks if chunk.sample]
        batch = scheduler.update(StepResult(plan.step_id, sampled, [1] * len(sampled)))
        if step >= args.warmup:
            times.append(time.perf_counter() - began)
        for _ in range(sum(1 for item in batch.items if item.finish_reason)):
            scheduler.add(_submit(next(numbers), tenants, rng, args))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, nargs="+", default=[0, 1, 10, 100])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-blocks", type=int, default=16384)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    results: dict[int, list[float]] = {count: [] for count in args.tenants}
    for _ in range(args.rounds):
        for count in args.tenants:
            results[count].extend(step_seconds(count, args))
    base = statistics.median(results[args.tenants[0]])
    print(f"{'tenants':>8} {'p50 ms':>8} {'p90 ms':>8} {'p50 / first':>12}")
    for count, times in results.items():
        p50 = statistics.median(times)
        p90 = statistics.quantiles(times, n=10)[-1]
        print(f"{count:>8} {p50 * 1e3:8.3f} {p90 * 1e3:8.3f} {p50 / base:12.2f}")


if __name__ == "__main__":
    main()
