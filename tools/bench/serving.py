"""Online serving: our server and its peers (llama.cpp, vLLM), one after the other, one workload.

    python tools/bench/serving.py          # llama.cpp, vLLM: 1, 4, 16, 64 streams and 1 req/s
    python tools/bench/serving.py --peer llamacpp,vllm --precision q4_1 --streams 1,16 --rates none
    python tools/bench/serving.py --model demo --peer none --streams 1,4 --rates 4,inf \\
        --num-requests 16 --input-len 64 --output-len 16
    python tools/bench/serving.py --trace /work/shared/traces/mooncake_fast25_conversation.jsonl \\
        --window 40 --input-scale 32
    python tools/bench/serving.py --model FILE.gguf --precision q4_1 --peer llamacpp \\
        --streams 1,8 --rates none --rounds 3      # alternating rounds, each with its ratio

Every server serves the same model (SmolLM2-135M-Instruct from its GGUF file unless --model;
`--model demo`: the random demo model) on 127.0.0.1 at a free port and gets the same requests.
--precision float32 (default): the engine and vLLM serve the model's float32 HF export,
llama-server an F32 copy of its GGUF file (tools/peers/llamacpp_peer.py makes it once); q4_1: the
engine and llama-server serve the GGUF file itself (the default model's is Q4_1) and vLLM, which
cannot serve it on the CPU, the float32 export (its rows say so). llama-server runs with 2
threads and --llamacpp-parallel slots, its context that many slots of the longest request.
Requests go through the replay client (engine/trace/client.py): streamed completions of token-id
prompts, greedy, EOS ignored, so every output is exactly as long as asked. Loads: for each N of
--streams, a closed loop of N streams each sending --requests-per-stream requests back to back;
for each rate of --rates, Poisson arrivals (`inf`: all at once); each load has prompts of its own,
so none hits the prefix cache another one filled. Or, with --trace, a time window of a trace
(Mooncake JSONL or Azure CSV, inputs divided by --input-scale, arrival times kept). The engine
runs first, then each peer of --peer; each server is warmed up with two short requests, runs
every load, and is stopped (SIGTERM, a wait, then SIGKILL for it and anything it left in its
session) before the next one starts. --rounds N does all that N times, every other round in the
reverse order (the peers first), and prints each ratio's lowest and highest over the rounds.

Printed: one table, for each load and server: requests served, req/s, output tok/s, TTFT p50 /
p99, TPOT p50 / p99 (per request: (end - first token) / (tokens - 1)), ITL p50 / p99, then one
ratio row per peer: throughput engine / peer, latency peer / engine, so > 1 means the engine is
better in every column. Under it, per load, the engine's own figures from its GET /metrics just
before and after (after a scheduler report's wait): steps, compute ms per step and its share of the
load's time, gaps between two steps of a running batch, their mean and the scheduler's part,
output tokens per compute second (the raw model's decode rate while serving), and each actor's
CPU in % of one core; "—" where the engine exports no such metric. --json: the same as one
object. Figures of one run compare; absolute figures drift across runs on a shared machine.
Exit status 1 when a server fails to start (one line names it) or a request fails.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `engine` and `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.bench.loads import (
    check_load_arguments,
    describe_loads,
    loads_of,
    slot_context,
    trace_load,
    warmup_load,
)
from engine.bench.serve import Server, add_arguments, run_servers
from engine.client.servers import engine_server
from tools.peers import llamacpp_peer
from tools.peers.vllm_peer import DEFAULT_VLLM_PYTHON, vllm_python, vllm_server

PEERS = ("llamacpp", "vllm")
PRECISIONS = ("float32", "q4_1")


@dataclass(frozen=True)
class Files:
    """What each server serves at the chosen precision."""

    engine: str
    llamacpp: Path | None  # a GGUF file
    vllm: str | None  # an HF checkpoint directory

    def describe(self, precision: str) -> str:
        if precision == "float32":
            parts = [f"{'engine and vLLM serve' if self.vllm else 'engine serves'} {self.engine}"]
            if self.llamacpp:
                parts.append(f"llama.cpp {self.llamacpp}")
        else:
            serve = "engine and llama.cpp serve" if self.llamacpp else "engine serves"
            parts = [f"{serve} {self.engine}"]
            if self.vllm:
                parts.append(f"vLLM the float32 export {self.vllm} (no GGUF on its CPU backend)")
        return f"{precision}: " + "; ".join(parts)


def files_for(model: str | None, precision: str, peers: list[str]) -> Files:
    from engine.launch.model_source import hf_checkpoint
    from engine.settings.home import default_engine_home

    home = default_engine_home()
    export = hf_checkpoint(model, home) if precision == "float32" or "vllm" in peers else None
    gguf = None
    if precision == "q4_1" or "llamacpp" in peers:
        gguf = _gguf_file(model, precision)
    if precision == "float32":
        assert export is not None
        llamacpp = llamacpp_peer.f32_file(gguf) if gguf and "llamacpp" in peers else None
        return Files(export, llamacpp, export if "vllm" in peers else None)
    assert gguf is not None
    return Files(str(gguf), gguf if "llamacpp" in peers else None, export)


def _gguf_file(model: str | None, precision: str) -> Path:
    try:
        return llamacpp_peer.model_file(model)
    except SystemExit:
        why = "llama.cpp's F32 copy is made from" if precision == "float32" else "q4_1 serves"
        raise SystemExit(
            f"bench serve: --model must be a .gguf file ({why} it), got {model!r}"
        ) from None


def main() -> int:
    args = parse_args()
    loads = [trace_load(args)] if args.trace else loads_of(args)
    if "llamacpp" in args.peer:
        llamacpp_peer.binaries()  # built before the engine's run, not after
    files = files_for(args.model, args.precision, args.peer)
    logs = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    servers: dict[str, Server] = {
        "engine": partial(
            engine_server, files.engine, logs, shlex.split(args.engine_args), args.start_timeout
        ),
    }
    for peer in args.peer:
        if peer == "llamacpp":
            assert files.llamacpp is not None
            slots = args.llamacpp_parallel
            context = slots * slot_context([warmup_load(), *loads])
            servers["llama.cpp"] = partial(
                llamacpp_peer.llama_server,
                files.llamacpp,
                slots,
                context,
                logs,
                args.start_timeout,
            )
        elif peer == "vllm":
            assert files.vllm is not None
            python = vllm_python(args.vllm_python)  # found before the engine's run, not after
            label = "vLLM" if args.precision == "float32" else "vLLM (float32)"
            servers[label] = partial(
                vllm_server,
                python,
                files.vllm,
                logs,
                shlex.split(args.vllm_args),
                args.start_timeout,
            )
    describe = f"{describe_loads(args, loads)}; {files.describe(args.precision)}"
    if "llamacpp" in args.peer:
        describe += f" (llama-server -t {llamacpp_peer.THREADS} -np {args.llamacpp_parallel})"
    status = run_servers(args, loads, servers, describe)
    if status == 0:
        shutil.rmtree(logs)  # kept when a server failed: the message names its log
    return status


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        help="checkpoint directory, .gguf file or 'demo' (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--peer",
        type=_peers,
        default=["llamacpp", "vllm"],
        help="peers after the engine, comma-separated: llamacpp, vllm; none: the engine alone "
        "(default llamacpp,vllm)",
    )
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="float32",
        help="float32: the float32 export (llama.cpp: an F32 GGUF copy); q4_1: the GGUF file "
        "itself for the engine and llama.cpp, vLLM still float32 (default float32)",
    )
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument(
        "--llamacpp-parallel",
        type=int,
        default=None,
        help="llama-server's slots (-np; default the most --streams, at least 16)",
    )
    p.add_argument(
        "--vllm-args",
        default="",
        help="more flags for vLLM's api_server, e.g. --vllm-args='--max-num-seqs 64'",
    )
    add_arguments(p)
    args = p.parse_args()
    check_load_arguments(p, args)
    if args.llamacpp_parallel is None:  # a slot per stream: none waits in llama-server's queue
        args.llamacpp_parallel = max([16, *args.streams])
    if args.llamacpp_parallel < 1:
        p.error(f"--llamacpp-parallel must be >= 1, got {args.llamacpp_parallel}")
    return args


def _peers(text: str) -> list[str]:
    """'llamacpp,vllm' -> ["llamacpp", "vllm"] (in that order, once each); 'none' -> []."""
    parts = [part.strip() for part in text.split(",")]
    if parts == ["none"]:
        return []
    if not parts or not all(part in PEERS for part in parts):
        raise argparse.ArgumentTypeError(
            f"expected peers from {', '.join(PEERS)} (comma-separated) or none, got {text!r}"
        )
    return list(dict.fromkeys(parts))


if __name__ == "__main__":
    sys.exit(main())
