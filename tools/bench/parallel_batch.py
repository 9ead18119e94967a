"""Static-batch figures of the raw model split over processes, for bench_one_batch's --tp/--dp.

tp x dp rank processes are spawned. Each replica's tp ranks form one torch.distributed group
(gloo on CPU, NCCL on CUDA; a free local port per replica) and load their shard; rank 0 picks the
greedy tokens and broadcasts them, as the engine's rank 0 samples for its group. A replica takes
its share of each batch (as even as it goes, the first replicas one more), and all replicas start
each case together at a barrier. A case's figures are the slowest replica's: its prefill, and its
median decode step (the whole batch advances one token per slowest step); tokens are counted
over every replica. Each rank holds as many KV blocks as the TP=1 / DP=1 runner it is compared
with, and the host's threads are shared among the ranks as the engine shares them.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import socket
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from engine.bench.raw_model import (
    CaseResult,
    bench_case,
    decode_steps,
    prefill_batch,
    random_prompts,
    static_block_tables,
)
from engine.model.placement.policy import sleeping_openmp_threads

RESULT_TIMEOUT_S = 1800.0
JOIN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class RankJob:
    model: str
    replica: int
    rank: int
    tp: int
    port: int
    dtype: str
    device: str
    block_size: int
    num_blocks: int  # KV blocks per rank, as many as the baseline runner has
    num_threads: int
    cases: list[tuple[int, int, int]]  # (this replica's batch share, input len, output len)


def shares(batch_size: int, dp: int) -> list[int]:
    """How `batch_size` sequences split over `dp` replicas."""
    return [batch_size // dp + (1 if r < batch_size % dp else 0) for r in range(dp)]


def parallel_cases(
    model: str,
    tp: int,
    dp: int,
    cases: list[tuple[int, int, int]],
    *,
    dtype: str,
    device: str,
    block_size: int,
    num_blocks: int,
    num_threads: int | None,
) -> list[CaseResult]:
    """Each (batch, input len, output len) case run on tp x dp ranks; one CaseResult per case."""
    cores = len(os.sched_getaffinity(0))
    threads = num_threads or max(1, (cores - 1) // (tp * dp))
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(tp * dp)
    out: Any = context.Queue()
    ports = [_free_port() for _ in range(dp)]
    processes = []
    sleeping_openmp_threads()  # as the engine's workers; the rank processes inherit it
    for replica in range(dp):
        replica_cases = [(shares(b, dp)[replica], i, o) for b, i, o in cases]
        for rank in range(tp):
            job = RankJob(
                model,
                replica,
                rank,
                tp,
                ports[replica],
                dtype,
                device,
                block_size,
                num_blocks,
                threads,
                replica_cases,
            )
            processes.append(context.Process(target=_rank_main, args=(job, barrier, out)))
    for process in processes:
        process.start()
    try:
        per_replica = [out.get(timeout=RESULT_TIMEOUT_S) for _ in range(dp)]
    except queue.Empty:
        raise RuntimeError(f"the tp={tp} x dp={dp} ranks sent no figures in time") from None
    finally:
        for process in processes:
            process.join(timeout=JOIN_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()
    failed = [f"replica {r}: {figures}" for r, figures in per_replica if isinstance(figures, str)]
    if failed:
        raise RuntimeError("; ".join(failed))
    results = []
    for index, (batch, input_len, output_len) in enumerate(cases):
        timed = [figures[index] for _, figures in per_replica if figures[index] is not None]
        results.append(
            CaseResult(
                batch,
                input_len,
                output_len,
                max(prefill for prefill, _ in timed),
                max(step for _, step in timed),
            )
        )
    return results


def _rank_main(job: RankJob, barrier: Any, out: Any) -> None:
    try:
        figures: list[tuple[float, float] | None] | str = _run_rank(job, barrier)
    except Exception as exc:  # reported, so that the parent does not wait for nothing
        figures = f"{type(exc).__name__}: {exc}"
        barrier.abort()
    if job.rank == 0 or isinstance(figures, str):
        out.put((job.replica, figures))


def _run_rank(job: RankJob, barrier: Any) -> list[tuple[float, float] | None]:
    from engine.model.config import load_model_config
    from engine.model.parallel.group import join_group, open_store, wait_for_ranks
    from engine.model.placement.capacity import kv_block_bytes
    from engine.model.placement.policy import resolve_dtype
    from engine.model.runner import ModelRunner

    group = None
    if job.tp > 1:
        store = open_store(job.rank, job.tp, "127.0.0.1", job.port, 120.0)
        wait_for_ranks(store, job.tp, 120.0, f"127.0.0.1:{job.port}")
        group = join_group(store, job.rank, job.tp, torch.device(job.device))
    config = load_model_config(job.model)
    dtype = resolve_dtype(job.dtype, config.torch_dtype, job.device)
    runner = ModelRunner(
        job.model,
        dtype=job.dtype,
        device=job.device,
        block_size=job.block_size,
        kv_cache_memory=job.num_blocks * kv_block_bytes(config, job.block_size, dtype, job.tp),
        kv_cache_dtype=dtype,
        num_threads=job.num_threads,
        tensor_parallel=group,
    )
    pick = _RankZeroPick(runner)
    pick.rows = 1
    bench_case(runner, 1, 16, 4, pick)  # warm-up, as the baseline's
    figures: list[tuple[float, float] | None] = []
    for share, input_len, output_len in job.cases:
        barrier.wait()
        if share == 0:
            figures.append(None)
            continue
        pick.rows = share
        tables = static_block_tables(runner, share, input_len + output_len)
        prompts = random_prompts(runner, share, input_len)
        tokens, prefill_seconds = prefill_batch(runner, prompts, tables, pick)
        _, seconds = decode_steps(runner, tokens, input_len, tables, max(output_len - 1, 1), pick)
        figures.append((prefill_seconds, statistics.median(seconds)))
    if group is not None:
        group.close()
    return figures


class _RankZeroPick:
    """Greedy tokens: rank 0 (the only one with logits) picks them and broadcasts them to the
    group, as the engine's rank 0 samples for its group; `rows` tokens per step."""

    def __init__(self, runner: Any) -> None:
        self.group = runner.group
        self.argmax_rows = runner.backend.argmax_rows
        self.rows = 0

    def __call__(self, logits: torch.Tensor) -> list[int]:
        if self.group.size == 1:
            return self.argmax_rows(logits).tolist()
        import torch.distributed as dist

        if self.group.is_first:
            tokens = self.argmax_rows(logits).to(self.group.device, torch.int64).contiguous()
        else:
            tokens = torch.empty(self.rows, dtype=torch.int64, device=self.group.device)
        dist.broadcast(tokens, src=0)
        return tokens.tolist()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
