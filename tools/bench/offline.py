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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a script: make `engine` and `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.bench.offline import Run, Workload, add_arguments, check_arguments, run_offline
from tools.peers import llamacpp_peer
from tools.peers.vllm_peer import DEFAULT_VLLM_PYTHON, vllm_python


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
            body = {
                "prompt": prompt,
                "n_predict": n,
                "temperature": 0.0,
                "ignore_eos": True,
                "cache_prompt": False,
                "return_tokens": True,
            }
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
    parser.add_argument("--peer", choices=["hf", "vllm", "llamacpp", "none"], default="hf")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    add_arguments(parser)
    args = parser.parse_args()
    check_arguments(parser, args)

    from engine.launch.model_source import hf_checkpoint, model_directory
    from engine.settings.home import default_engine_home

    if args.peer == "llamacpp":  # the GGUF file itself: the float32 export is for the others
        path, _ = model_directory(args.model, default_engine_home())
        llamacpp_peer.binaries()  # built before the engine's run, not after
    else:
        path = hf_checkpoint(args.model, default_engine_home())
    run_offline(args, path, None if args.peer == "none" else PEERS[args.peer])


if __name__ == "__main__":
    main()
