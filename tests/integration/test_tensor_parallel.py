"""Tensor parallelism, TP=2 on gloo: greedy tokens equal TP=1's and transformers' for every
architecture (a model with fewer KV heads than ranks, a tied-embedding one and a vocabulary that
does not split evenly among them), at the model level (two rank processes running ModelRunner)
and through the whole engine; the group restarts together and meets again on a fresh port.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.config import load_model_config
from engine.model.placement.capacity import kv_block_bytes
from engine.model.runner import ModelRunner
from tests.checkpoints import TIE_TOLERANCE, greedy_generate, tiny_checkpoint
from tests.e2e.harness import free_port
from tests.hf_reference import assert_greedy_matches_hf
from tests.ipc_files import ipc_files

ARCHS = {
    "llama": {"arch": "llama"},
    "qwen2": {"arch": "qwen2"},  # q/k/v biases split with their heads
    "qwen3-tied": {"arch": "qwen3", "tie_word_embeddings": True},  # q/k norms, tied LM head
    "llama-1kv": {"arch": "llama", "num_kv_heads": 1},  # one KV head for two ranks: replicated
    "llama-odd-vocab-bias": {"arch": "llama", "vocab_size": 511, "attention_bias": True},
    "mistral-window": {"arch": "mistral", "extra": {"sliding_window": 7}},  # windows per head
    "gemma2-softcaps": {  # sandwich norms on whole hidden states, capped scores and logits
        "arch": "gemma2",
        "tie_word_embeddings": True,
        "head_dim": 16,
        "extra": {
            "sliding_window": 6,
            "query_pre_attn_scalar": 16,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
        },
    },
}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], list(range(100, 137))]
NEW_TOKENS = 8
RESULT_TIMEOUT_S = 240.0


class _LogitsOnEveryRank:
    """A runner whose forward hands rank 0's logits to every rank, so each rank can pick the
    same next tokens (in the engine only rank 0 samples and the scheduler feeds the rest)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.num_blocks = runner.num_blocks
        self.block_size = runner.block_size
        self.first_logits: list[list[float]] | None = None

    def forward(self, chunks: Any) -> torch.Tensor:
        import torch.distributed as dist

        # Contiguous: the gathered logits may be a view without the padded vocabulary rows, and
        # a broadcast sends the tensor's memory as it lies.
        logits = self.runner.forward(chunks).contiguous()
        rows = torch.tensor([logits.shape[0]])
        dist.broadcast(rows, src=0)
        if self.runner.group.rank != 0:
            logits = torch.empty(int(rows), self.runner.config.vocab_size)
        dist.broadcast(logits, src=0)
        if self.first_logits is None:
            self.first_logits = logits.tolist()
        return logits


def _rank_main(rank: int, size: int, port: int, paths: list[str], out: Any) -> None:
    """One rank: join the group, greedy-decode every checkpoint; rank 0 reports."""
    from engine.model.parallel.group import join_group, open_store, wait_for_ranks

    torch.set_num_threads(1)
    store = open_store(rank, size, "127.0.0.1", port, 60.0)
    wait_for_ranks(store, size, 60.0, f"127.0.0.1:{port}")
    group = join_group(store, rank, size, torch.device("cpu"))
    results = {}
    for path in paths:
        runner = ModelRunner(path, kv_cache_memory=2**20, tensor_parallel=group, num_threads=1)
        shared = _LogitsOnEveryRank(runner)
        tokens = greedy_generate(shared, PROMPTS, NEW_TOKENS, chunk_size=5)
        results[path] = (tokens, shared.first_logits)
    if rank == 0:
        out.put(results)
    group.close()


@pytest.fixture(scope="module")
def tp2_results() -> Iterator[dict[str, tuple[list[list[int]], list[list[float]]]]]:
    """Greedy tokens and first-step logits of every checkpoint, from two rank processes."""
    paths = [str(tiny_checkpoint(**spec)) for spec in ARCHS.values()]
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_rank_main, args=(r, 2, port, paths, out)) for r in range(2)]
    for process in ranks:
        process.start()
    try:
        yield out.get(timeout=RESULT_TIMEOUT_S)
    except queue.Empty:
        pytest.fail(f"the TP=2 ranks sent no result within {RESULT_TIMEOUT_S:g} s")
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()


class _LogitsFree:
    """TP=1 runner that remembers its first logits (as _LogitsOnEveryRank does)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.num_blocks = runner.num_blocks
        self.block_size = runner.block_size
        self.first_logits: torch.Tensor | None = None

    def forward(self, chunks: Any) -> torch.Tensor:
        logits = self.runner.forward(chunks)
        if self.first_logits is None:
            self.first_logits = logits
        return logits


@pytest.mark.parametrize("name", list(ARCHS))
def test_tp2_greedy_equals_tp1_and_transformers(name: str, tp2_results: dict[str, Any]) -> None:
    path = str(tiny_checkpoint(**ARCHS[name]))
    tokens, first_logits = tp2_results[path]
    single = _LogitsFree(ModelRunner(path, kv_cache_memory=2**20))
    reference = greedy_generate(single, PROMPTS, NEW_TOKENS, chunk_size=5)
    # Same logits up to float32 summation order (the row-parallel sums add in another order).
    torch.testing.assert_close(
        torch.tensor(first_logits), single.first_logits, rtol=1e-4, atol=1e-4
    )
    for prompt, ours, theirs in zip(PROMPTS, tokens, reference, strict=True):
        _assert_same_or_tie(ours, theirs, single.runner, prompt)
        assert_greedy_matches_hf(path, prompt, ours)


def _assert_same_or_tie(
    ours: list[int], theirs: list[int], runner: ModelRunner, prompt: list[int]
) -> None:
    """TP=2 tokens equal TP=1's, or diverge only where TP=1's top-2 logits tie."""
    for step, (mine, single) in enumerate(zip(ours, theirs, strict=True)):
        if mine == single:
            continue
        from engine.model.step_inputs import SeqChunk

        context = prompt + theirs[:step]
        blocks = list(range(-(-len(context) // runner.block_size)))
        logits = runner.forward([SeqChunk(0, context, 0, blocks, True)])[0]
        gap = float(logits[single] - logits[mine])
        assert gap < TIE_TOLERANCE, f"TP=2 {ours} and TP=1 {theirs} diverge at step {step}"
        return


# ---- through the engine: ranks as actors, one supervised group --------------------------------


@pytest.fixture(scope="module")
def engine_path() -> str:
    return str(tiny_checkpoint(arch="qwen3", num_kv_heads=2))


@pytest.fixture(autouse=True)
def no_leftover_segments() -> Iterator[None]:
    """Replaces the suite's per-test check: a restarted group gets fresh segments that live as
    long as the module's engine; the `llm` fixture checks that none are left after it closes."""
    yield


@pytest.fixture(scope="module")
def llm(engine_path: str) -> Iterator[LLM]:
    before = ipc_files()
    with LLM(engine_path, tensor_parallel_size=2, kv_cache_memory=2**20) as engine:
        yield engine
    assert sorted(ipc_files() - before) == []


def test_engine_with_two_ranks_matches_transformers(llm: LLM, engine_path: str) -> None:
    long_prompt = [3 + i % 500 for i in range(600)]  # its step runs in a thread
    prompts = [*PROMPTS, long_prompt]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert len(out.outputs[0].token_ids) == NEW_TOKENS
        assert_greedy_matches_hf(engine_path, prompt, out.outputs[0].token_ids)


def test_kv_blocks_are_sized_by_one_ranks_kv_heads(llm: LLM, engine_path: str) -> None:
    config = load_model_config(engine_path)
    per_rank = kv_block_bytes(config, 16, "float32", 2)
    assert per_rank * 2 == kv_block_bytes(config, 16, "float32", 1)  # 2 KV heads, 1 per rank
    assert llm.stats().kv_cache_blocks == 2**20 // per_rank


def test_killing_one_rank_restarts_the_group_on_a_fresh_port(llm: LLM, engine_path: str) -> None:
    before = {row.name: row for row in llm.engine.actors()}
    old_ports = _listening_ports(before["worker0"].pid)
    assert old_ports  # rank 0 serves the group's TCP store
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    os.kill(before["worker1"].pid, signal.SIGKILL)
    outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert_greedy_matches_hf(engine_path, prompt, out.outputs[0].token_ids)
    after = {row.name: row for row in llm.engine.actors()}
    # one_for_all within the group: rank 0 went down and came back with rank 1.
    assert after["worker0"].restarts == 1 and after["worker1"].restarts == 1
    assert after["scheduler"].restarts == 0
    assert after["worker0"].pid != before["worker0"].pid
    # The new rank 0 picked its store's port afresh: none of the old group's ports.
    assert not _listening_ports(after["worker0"].pid) & old_ports


def _listening_ports(pid: int) -> set[int]:
    """TCP ports process `pid` listens on (its sockets' inodes matched in /proc/net/tcp)."""
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports
