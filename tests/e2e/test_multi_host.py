"""Two launches of `python -m engine` on loopback form one TP=2 group across "hosts"
(`--nnodes 2 --node-rank 0|1 --master-addr --master-port`), serve a greedy completion that
transformers agrees with token for token (and logprob for logprob), and both stop cleanly
leaving no process and no segment behind. Invalid topologies fail at the command line with a
non-zero exit and one line that names the numbers at fault.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.checkpoints import hf_greedy
from tests.e2e.conftest import server_args
from tests.e2e.harness import (
    REPO,
    Server,
    free_port,
    leftover_ipc,
    read_line_starting,
    spawn_engine,
    start_server,
    stop_process,
)
from tests.hf_reference import hf_tokenizer
from tests.integration.test_fault_tolerance import alive, children_of

NEW_TOKENS = 12
NO_TIE = 1e-3  # HF's top-2 logits at least this far apart at every step of the chosen prompt
START_TIMEOUT_S = 180.0
CANDIDATE_PROMPTS = [[5 + 13 * i + k for k in range(9)] for i in range(12)]


def topology_flags(node_rank: int, port: int) -> list[str]:
    return [
        "--tp",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        str(node_rank),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
    ]


@dataclass
class WorkerNode:
    proc: subprocess.Popen[str]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 60.0) -> int:
        return stop_process(self.proc, timeout)


def start_worker_node(args: list[str], log_dir: Path) -> WorkerNode:
    """`python -m engine serve ... --node-rank 1`, not waited for: it is ready only once node 0
    has started too (the group forms when both ranks are there)."""
    log_path = log_dir / "node1.log"
    return WorkerNode(spawn_engine(["serve", *args], log_path), log_path)


@dataclass
class TwoHosts:
    head: Server
    node: WorkerNode
    port: int
    processes: dict[int, str]  # every process of both launches, as they run: pid -> command


@pytest.fixture(scope="module")
def two_hosts(
    model_args: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TwoHosts]:
    work = tmp_path_factory.mktemp("two-hosts")
    port = free_port()
    node = start_worker_node(server_args(model_args, None, *topology_flags(1, port)), work)
    head: Server | None = None
    try:
        args = server_args(model_args, work / "admin.sock", *topology_flags(0, port))
        head = start_server(args, work, name="node0")
        ready = read_line_starting(node.proc, "engine worker node", START_TIMEOUT_S)
        assert ready.startswith("engine worker node 1/2 ready: worker1"), node.log()
        processes = {head.pid: "node 0", node.proc.pid: "node 1"}
        for launch in (head.pid, node.proc.pid):
            processes.update(children_of(launch))
        yield TwoHosts(head, node, port, processes)
    finally:
        if head is not None:
            head.stop()
        node.stop()


def greedy_prompt(path: str) -> tuple[list[int], list[int], torch.Tensor]:
    """A prompt whose greedy continuation has no near-tie at any step, so that a TP=2 sum in
    another order cannot legitimately pick another token; (prompt, HF tokens, HF logits)."""
    for prompt in CANDIDATE_PROMPTS:
        tokens, logits = hf_greedy(Path(path), prompt, NEW_TOKENS)
        top2 = logits.topk(2, dim=-1).values
        if len(tokens) == NEW_TOKENS and bool((top2[:, 0] - top2[:, 1] > NO_TIE).all()):
            return prompt, tokens, logits
    pytest.fail(f"every candidate prompt has a near-tie (< {NO_TIE}) in HF's greedy path")


def test_two_launches_form_one_tp2_group_and_serve_what_transformers_would(
    two_hosts: TwoHosts, model_args: list[str]
) -> None:
    head = two_hosts.head
    path = model_args[1]
    actors = {row["name"]: row for row in head.admin("actors")}
    # Node 0 runs rank 0 (and the rest of the pipeline); rank 1 lives in the other launch.
    assert "worker0" in actors and "worker1" not in actors
    assert "worker1" in two_hosts.node.log()
    prompt, hf_tokens, hf_logits = greedy_prompt(path)
    body = {
        "model": head.model,
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
    }
    with head.http() as http:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    tokenizer = hf_tokenizer(path)
    hf_texts = [
        tokenizer.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        for t in hf_tokens
    ]
    assert logprobs["tokens"] == hf_texts
    hf_logprobs = torch.log_softmax(hf_logits, dim=-1)
    expected = [float(hf_logprobs[step, token]) for step, token in enumerate(hf_tokens)]
    assert logprobs["token_logprobs"] == pytest.approx(expected, abs=1e-4)


def test_both_launches_stop_cleanly_and_leave_nothing(two_hosts: TwoHosts) -> None:
    head, node = two_hosts.head, two_hosts.node
    assert len(two_hosts.processes) >= 6  # the launches, 4 actors on node 0, rank 1 on node 1
    assert head.stop() == 0, head.log()
    assert node.stop() == 0, node.log()
    assert [f"{pid}: {what}" for pid, what in two_hosts.processes.items() if alive(pid)] == []
    assert leftover_ipc(head.pid) == [] and leftover_ipc(node.proc.pid) == []


# ---- invalid topologies -----------------------------------------------------------------------


def run_serve(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine", "serve", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        # The tiny checkpoint has 4 attention heads, 2 KV heads, 128 MLP columns.
        (["--tp", "3"], ["tensor_parallel_size 3", "num_attention_heads 4"]),
        (["--tp", "8"], ["tensor_parallel_size 8", "num_attention_heads 4"]),
        (["--tp", "2", "--nnodes", "2", "--node-rank", "2"], ["node_rank 2", "nnodes 2"]),
        (["--tp", "3", "--nnodes", "2"], ["tensor_parallel_size 3", "nnodes 2"]),
        (["--tp", "2", "--nnodes", "2", "--master-port", "0"], ["master_port", "nnodes is 2"]),
        (
            ["--tp", "2", "--dp", "2", "--nnodes", "2", "--master-port", "65535"],
            ["master_port 65535", "replica 1", "65536"],
        ),
        (
            ["--tp", "8", "--nnodes", "2", "--node-rank", "1"],
            ["tensor_parallel_size 8", "num_attention_heads 4"],
        ),
    ],
    ids=[
        "tp-not-dividing-heads",
        "tp-above-heads",
        "node-rank-past-nnodes",
        "tp-not-split-over-hosts",
        "no-master-port",
        "master-port-past-replicas",
        "worker-node-tp-above-heads",
    ],
)
def test_an_invalid_topology_fails_with_one_line_naming_the_numbers(
    model_args: list[str], flags: list[str], named: list[str]
) -> None:
    needs_port = "--nnodes" in flags and "--master-port" not in flags
    defaults = ["--master-port", str(free_port())] if needs_port else []
    args = [*model_args, "--device", "cpu", "--port", "0", "--kv-cache-memory", "4MiB"]
    done = run_serve([*args, *defaults, *flags])
    assert done.returncode != 0 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("engine: ")
    for part in named:
        assert part in lines[0], lines[0]
