"""Offline throughput: N requests through the engine, and the same workload through a peer.

    python tools/bench/offline.py --num-requests 32 --input-len 32 --output-len 64 --peer hf
    python tools/bench/offline.py --num-requests 1 --peer vllm --vllm-python ~/vllm-peer/bin/python
    python tools/bench/offline.py --tp 2 --dp 2 --peer none    # against TP=1 / DP=1, same run
    python tools/bench/offline.py --num-requests 16 --input-len 256 --output-len 128 --peer llamacpp

Prompts are random token ids (seeded); every request decodes exactly its output length (greedy, EOS
ignored), so both sides do the same work. Peers: `hf` (transformers' generate, batched, in this
process), `vllm` (vLLM's LLM in its own virtual environment, docs/benchmarks.md, Peers; a
subprocess), or `llamacpp` (llama.cpp's llama-server with 2 threads and one slot per request, every
request sent at once; tools/peers/llamacpp_peer.py builds it once; both sides then read the GGUF
file itself, not its float32 export), or `none`. With --tp or --dp above 1 the engine also runs the
workload at TP=1 / DP=1 first, and the parallel figures are reported against it. The figures of one
run are comparable; across runs on a 2-core machine they drift. `--repeats N` times the workload N
times on each side, each time with fresh prompts (a prefix-cache hit would skip the prefill), and
reports the median: a short workload (one sequence of 64 tokens takes ~0.3 s) timed once is mostly
noise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tools.peers import llamacpp_peer
from tools.peers.vllm_peer import DEFAULT_VLLM_PYTHON, vllm_python

# The prompts (token ids) and each one's output length.
Workload = tuple[list[list[int]], list[int]]


@dataclass
class Run:
    name: str
    seconds: list[float]  # one per repeat
    output_tokens: list[int]  # one per repeat
    outputs: list[list[int]]  # every repeat's, in order

    @property
    def tokens_per_s(self) -> float:
        rates = zip(self.output_tokens, self.seconds, strict=True)
        return statistics.median(tokens / seconds for tokens, seconds in rates)

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)


def make_workloads(args: argparse.Namespace, vocab_size: int) -> list[Workload]:
    return [make_workload(args, vocab_size, args.seed + r) for r in range(args.repeats)]


def make_workload(args: argparse.Namespace, vocab_size: int, seed: int) -> Workload:
    rng = random.Random(seed)

    def length(mean: int) -> int:
        spread = int(mean * args.range_ratio)
        return max(1, rng.randint(mean - spread, mean + spread))

    prompts = [
        [rng.randrange(10, vocab_size) for _ in range(length(args.input_len))]
        for _ in range(args.num_requests)
    ]
    return prompts, [length(args.output_len) for _ in prompts]


def run_engine(
    args: argparse.Namespace,
    path: str,
    workloads: list[Workload],
    tp: int = 1,
    dp: int = 1,
    name: str = "engine",
    deterministic: bool = False,
) -> Run:
    from engine import LLM, SamplingParams

    options = {
        "tensor_parallel_size": tp,
        "data_parallel_size": dp,
        "kv_cache_memory": args.kv_cache_memory,
        "scheduler__max_num_seqs": max(len(workloads[0][0]), 1),
        "model__deterministic": deterministic,
        "device": args.device,
        "dtype": args.dtype,
        "model__kernel_backend": args.kernel_backend,
    }
    run = Run(name, [], [], [])
    with LLM(path, **options) as llm:
        warm = workloads[0][0][:2]
        llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        for prompts, outs in workloads:
            params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in outs]
            start = time.perf_counter()
            results = llm.generate(prompts, params)
            run.seconds.append(time.perf_counter() - start)
            tokens = [r.outputs[0].token_ids for r in results]
            run.output_tokens.append(sum(map(len, tokens)))
            run.outputs += tokens
    return run


def run_hf(args: argparse.Namespace, path: str, workloads: list[Workload]) -> Run:
    import torch
    from transformers import AutoModelForCausalLM

    # float32 on the CPU (HF's fastest there); on a GPU the dtype we run in.
    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    dtype = torch.float32 if not on_gpu else getattr(torch, args.dtype, torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = model.to("cuda" if on_gpu else "cpu").eval()
    pad = 0
    run = Run("hf", [], [], [])
    warm = torch.tensor([workloads[0][0][0][:4]], device=model.device)
    with torch.inference_mode():
        model.generate(warm, max_new_tokens=2, do_sample=False, pad_token_id=pad)
        for prompts, outs in workloads:
            start = time.perf_counter()
            for first in range(0, len(prompts), args.hf_batch_size):
                batch = prompts[first : first + args.hf_batch_size]
                wanted = outs[first : first + args.hf_batch_size]
                width = max(map(len, batch))
                ids = torch.tensor(  # left padding
                    [[pad] * (width - len(p)) + p for p in batch], device=model.device
                )
                mask = torch.tensor(
                    [[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device
                )
                new = max(wanted)
                out = model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=pad,
                )
                run.outputs += [
                    row[width : width + n].tolist() for row, n in zip(out, wanted, strict=True)
                ]
            run.seconds.append(time.perf_counter() - start)
            run.output_tokens.append(sum(outs))
    return run


VLLM_SCRIPT = r"""
import json, sys, time
def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["path"], dtype="float32", enforce_eager=True,
              gpu_memory_utilization=0.3, seed=0)
    warm = [TokensPrompt(prompt_token_ids=p) for p in spec["workloads"][0]["prompts"][:2]]
    llm.generate(warm, [SamplingParams(max_tokens=4, temperature=0.0)] * len(warm), use_tqdm=False)
    seconds, counts, tokens = [], [], []
    for workload in spec["workloads"]:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in workload["prompts"]]
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                  for n in workload["outs"]]
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        outputs = [list(r.outputs[0].token_ids) for r in results]
        counts.append(sum(map(len, outputs)))
        tokens += outputs
    print("RESULT " + json.dumps({"seconds": seconds, "counts": counts, "tokens": tokens}),
          flush=True)
if __name__ == "__main__":
    main()
"""


def run_vllm(args: argparse.Namespace, path: str, workloads: list[Workload]) -> Run:
    python = vllm_python(args.vllm_python)
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp, "spec.json")
        sets = [{"prompts": prompts, "outs": outs} for prompts, outs in workloads]
        spec.write_text(json.dumps({"path": path, "workloads": sets}))
        script = Path(tmp, "run_vllm.py")
        script.write_text(VLLM_SCRIPT)
        done = subprocess.run(
            [python, str(script), str(spec)], capture_output=True, text=True, timeout=1800
        )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line.removeprefix("RESULT "))
            return Run("vllm", result["seconds"], result["counts"], result["tokens"])
    raise SystemExit(f"vLLM run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def run_llamacpp(args: argparse.Namespace, path: str, workloads: list[Workload]) -> Run:
    """Each workload sent to llama-server at once, one slot per request (its offline mode)."""
    gguf = llamacpp_peer.model_file(args.model)
    slots = len(workloads[0][0])
    longest = max(
        len(p) + n for prompts, outs in workloads for p, n in zip(prompts, outs, strict=True)
    )
    context = slots * (-(-max(longest, 32) // 256) * 256)
    run = Run("llamacpp", [], [], [])
    with (
        tempfile.TemporaryDirectory() as logs,
        llamacpp_peer.llama_server(gguf, slots, context, Path(logs)) as url,
    ):
        asyncio.run(_llamacpp_generate(url, workloads[0][0][:2], [4, 4]))  # warm-up
        for prompts, outs in workloads:
            start = time.perf_counter()
            tokens = asyncio.run(_llamacpp_generate(url, prompts, outs))
            run.seconds.append(time.perf_counter() - start)
            run.output_tokens.append(sum(map(len, tokens)))
            run.outputs += tokens
    return run


async def _llamacpp_generate(
    url: str, prompts: list[list[int]], outs: list[int]
) -> list[list[int]]:
    """Greedy, EOS ignored, through llama-server's native /completion (it returns token ids)."""
    limits = httpx.Limits(max_connections=len(prompts) + 1)
    async with httpx.AsyncClient(base_url=url, timeout=1800.0, limits=limits) as client:

        async def one(prompt: list[int], n: int) -> list[int]:
            body = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "ignore_eos": True,
                    "cache_prompt": False, "return_tokens": True}  # fmt: skip
            reply = await client.post("/completion", json=body)
            reply.raise_for_status()
            return [int(t) for t in reply.json()["tokens"]]

        return list(await asyncio.gather(*map(one, prompts, outs)))


PEERS = {"hf": run_hf, "vllm": run_vllm, "llamacpp": run_llamacpp}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        help="checkpoint directory, .gguf file or 'demo' (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths vary ± this share")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats", type=int, default=1, help="time the workload this many times (fresh prompts)"
    )
    parser.add_argument("--peer", choices=["hf", "vllm", "llamacpp", "none"], default="hf")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per replica")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    parser.add_argument("--kv-cache-memory", type=int, default=512 * 2**20)
    parser.add_argument("--device", default="auto", help="auto (cuda if present), cpu, cuda")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument("--kernel-backend", default="auto", help="auto, torch, triton, cpu")
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="the engine in deterministic mode, against the default mode in the same run",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    from engine.home import default_engine_home
    from engine.model.config import load_model_config
    from engine.model_source import hf_checkpoint, model_directory

    if args.peer == "llamacpp":  # the GGUF file itself: the float32 export is for the others
        path, _ = model_directory(args.model, default_engine_home())
        llamacpp_peer.binaries()  # built before the engine's run, not after
    else:
        path = hf_checkpoint(args.model, default_engine_home())
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    workloads = make_workloads(args, load_model_config(path).vocab_size)
    baseline = None
    if args.tp > 1 or args.dp > 1 or args.deterministic:  # the reference first, same run
        baseline = run_engine(args, path, workloads, name=BASELINE)
    name = "engine_determ" if args.deterministic else "engine"
    runs = [
        run_engine(args, path, workloads, args.tp, args.dp, name, deterministic=args.deterministic)
    ]
    if args.peer != "none":
        runs.append(PEERS[args.peer](args, path, workloads))
    report(args, runs, baseline)


BASELINE = "engine_tp1_dp1"


def report(args: argparse.Namespace, runs: list[Run], baseline: Run | None) -> None:
    ours = runs[0]
    summary: dict[str, object] = {
        "num_requests": args.num_requests,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "tp": args.tp,
        "dp": args.dp,
        "deterministic": args.deterministic,
        "repeats": args.repeats,
    }
    for run in ([baseline] if baseline else []) + runs:
        summary[f"{run.name}_tok_per_s"] = round(run.tokens_per_s, 1)
        summary[f"{run.name}_seconds"] = round(run.median_seconds, 3)
    if baseline is not None:
        summary["parallel_ratio"] = round(ours.tokens_per_s / baseline.tokens_per_s, 3)
        summary["same_greedy_as_tp1_dp1"] = _same(ours, baseline)
    if len(runs) > 1:
        peer = runs[1]
        summary["ratio"] = round(ours.tokens_per_s / peer.tokens_per_s, 3)
        summary["same_greedy_outputs"] = _same(ours, peer)
    if args.json:
        print(json.dumps(summary))
        return
    mode = ", deterministic mode" if args.deterministic else ""
    repeats = f"; median of {args.repeats} runs" if args.repeats > 1 else ""
    print(
        f"{args.num_requests} requests, {args.input_len} in / {args.output_len} out, greedy; "
        f"engine at TP={args.tp} x DP={args.dp}{mode}{repeats}"
    )
    for run in ([baseline] if baseline else []) + runs:
        rates = ""
        if len(run.seconds) > 1:
            each = [f"{t / s:.0f}" for t, s in zip(run.output_tokens, run.seconds, strict=True)]
            rates = f"  runs: {', '.join(each)}"
        print(
            f"  {run.name:15s} {run.tokens_per_s:9.1f} output tok/s  "
            f"({run.median_seconds:.2f} s){rates}"
        )
    if baseline is not None:
        print(f"  ratio TP={args.tp} x DP={args.dp}{mode} / TP=1 x DP=1: "
              f"{summary['parallel_ratio']:.2f}x; identical greedy outputs: "
              f"{summary['same_greedy_as_tp1_dp1']}")  # fmt: skip
    if len(runs) > 1:
        print(f"  ratio engine / {runs[1].name}: {summary['ratio']:.2f}x; "
              f"identical greedy outputs: {summary['same_greedy_outputs']}")  # fmt: skip


def _same(a: Run, b: Run) -> str:
    """Whole outputs equal; and, since half precision drifts apart after a near tie, how far
    each pair agrees: the first token, and the median length of the agreeing prefix."""
    pairs = list(zip(a.outputs, b.outputs, strict=True))
    same = sum(x == y for x, y in pairs)
    first = sum(x[:1] == y[:1] for x, y in pairs)
    prefix = statistics.median(_agreeing_prefix(x, y) for x, y in pairs)
    return (
        f"{same}/{len(pairs)} (first token {first}/{len(pairs)}, "
        f"median agreeing prefix {prefix:.0f} tokens)"
    )


def _agreeing_prefix(x: list[int], y: list[int]) -> int:
    return next(
        (i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), min(len(x), len(y))
    )


if __name__ == "__main__":
    main()
