"""LoRA adapters served over HTTP, as vLLM serves them, by the shared e2e server (started with
--enable-lora): adapters loaded at run time generate peft + transformers' greedy tokens, in one
batch with the base model; /v1/models lists them with their parent; unknown and unloaded names
get 404 model_not_found; and a worker SIGKILLed mid-stream resumes a request of a run-time
adapter with the tokens it would have given undisturbed. (--lora-modules at start:
tests/unit/test_lora_model.py.)"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.checkpoints import hf_greedy, tiny_checkpoint
from tests.e2e.harness import Server, wait_until
from tests.holds import held
from tests.lora_adapters import ALL_MODULES, lora_adapter, peft_greedy

# Two full KV blocks and a bit: a request after another of the same prompt finds its blocks in
# the prefix cache, unless the two run with different adapters (or one with none).
# Held (tests/holds.py): a stream of it is still running when a worker is killed under it.
PROMPT = held([(7 * i + 11) % 500 for i in range(40)])


@pytest.fixture(scope="module")
def adapters() -> dict[str, Path]:
    base = tiny_checkpoint()
    return {
        "wide": lora_adapter(base, rank=8, targets=ALL_MODULES, seed=1, use_rslora=True),
        "narrow": lora_adapter(base, rank=4, targets=("q_proj", "v_proj"), seed=2, alpha=32),
    }


@pytest.fixture
def loaded(server: Server, adapters: dict[str, Path]) -> Iterator[dict[str, Path]]:
    """Adapters to load at run time in the shared server (--enable-lora), by name; whatever a
    test loaded is unloaded after it, so that the other tests see the base model alone."""
    names: dict[str, Path] = {}
    yield names
    with server.http() as http:
        for name in [*names, "again"]:
            http.post("/v1/unload_lora_adapter", json={"lora_name": name})


def load(server: Server, loaded: dict[str, Path], name: str, path: Path) -> httpx.Response:
    loaded[name] = path
    with server.http() as http:
        return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def completion(http: httpx.Client, model: str, max_tokens: int = 8) -> list[int]:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return list(reply.json()["choices"][0]["token_ids"])


def test_adapters_and_the_base_model_in_one_batch_give_peft_and_transformers_tokens(
    server: Server, adapters: dict[str, Path], loaded: dict[str, Path]
) -> None:
    base = tiny_checkpoint()
    assert load(server, loaded, "wide", adapters["wide"]).status_code == 200
    answer = load(server, loaded, "narrow", adapters["narrow"])
    assert answer.status_code == 200, answer.text
    assert answer.text == "Success: LoRA adapter 'narrow' added successfully."
    with server.http() as http:
        models = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
        assert set(models) == {server.model, "wide", "narrow"}
        assert models["narrow"]["parent"] == server.model
        assert models["narrow"]["root"] == str(adapters["narrow"])
        names = [server.model, "wide", "narrow"]
        one_by_one = [completion(http, name) for name in names]
        with ThreadPoolExecutor(2 * len(names)) as pool:  # arrive together: one batch
            tokens = list(pool.map(lambda name: completion(http, name), names * 2))
    assert tokens[:3] == tokens[3:] == one_by_one
    assert tokens[0] == hf_greedy(base, PROMPT, 8)[0]
    assert tokens[1] == peft_greedy(base, adapters["wide"], PROMPT, 8)[0]
    assert tokens[2] == peft_greedy(base, adapters["narrow"], PROMPT, 8)[0]


def test_load_and_unload_answer_as_vllm_and_unknown_names_are_model_not_found(
    server: Server, adapters: dict[str, Path], loaded: dict[str, Path], tmp_path: Path
) -> None:
    with server.http() as http:
        body = {"lora_name": "again", "lora_path": str(adapters["narrow"])}
        assert http.post("/v1/load_lora_adapter", json=body).status_code == 200
        twice = http.post("/v1/load_lora_adapter", json=body)
        assert twice.status_code == 400
        assert "has already been loaded" in twice.json()["error"]["message"]
        removed = http.post("/v1/unload_lora_adapter", json={"lora_name": "again"})
        assert removed.text == "Success: LoRA adapter 'again' removed successfully."
        for name in ("again", "never-loaded"):
            reply = http.post("/v1/completions", json={"model": name, "prompt": "hi"})
            assert reply.status_code == 404
            assert reply.json()["error"]["code"] == "model_not_found"
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "again"})
        assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]
        (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 64, "target_modules": []}))
        refused = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(tmp_path)}
        )
        assert refused.status_code == 400
        assert "its rank (r) exceeds --max-lora-rank 8" in refused.json()["error"]["message"]
        assert "big" not in {card["id"] for card in http.get("/v1/models").json()["data"]}
    anonymous = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=30)
    assert anonymous.status_code == 401


def test_adapter_loads_refuse_paths_outside_the_allowed_directories_and_odd_files(
    server: Server, tmp_path: Path
) -> None:
    """The attacks of issue 46: any server path was read, errors told whether it existed and
    echoed JSON values of files under it, a FIFO as adapter_config.json froze every route
    until something wrote to it, and a 2^62-byte header length answered 500."""
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "adapter_config.json").write_text(json.dumps({"r": "hunter2-token"}))
    fifo, huge = tmp_path / "fifo", tmp_path / "huge"
    fifo.mkdir()
    os.mkfifo(fifo / "adapter_config.json")
    shutil.copytree(lora_adapter(tiny_checkpoint(), rank=4, targets=("q_proj",), seed=2), huge)
    with (huge / "adapter_model.safetensors").open("r+b") as weights:
        weights.write(struct.pack("<Q", 1 << 62))
    with server.http() as http:

        def load_from(path: Path | str) -> httpx.Response:
            return http.post(
                "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(path)}
            )

        outside = [
            load_from(path)
            for path in ("/etc", "/nonexistent/adapter", f"{secret}/../../../../etc")
        ]
        assert [r.status_code for r in outside] == [403, 403, 403]
        assert len({r.text for r in outside}) == 1  # one answer: nothing told about the path
        echoed = load_from(secret)
        assert echoed.status_code == 400 and "hunter2" not in echoed.text
        assert "LoRA adapter 'x'" in echoed.json()["error"]["message"]
        stuck = load_from(fifo)
        assert stuck.status_code == 400 and "not a regular file" in stuck.text
        big = load_from(huge)
        assert big.status_code == 400 and "header length" in big.text
        assert http.get("/health").status_code == 200


def stream_tokens(server: Server, model: str, kill_pid: int | None = None) -> tuple[list[int], int]:
    """A streamed greedy completion's token ids, and how many had arrived when `kill_pid` (if
    given) was SIGKILLed, once the first tokens were there."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 80,  # held: 1.6 s after the first token, on any machine
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    tokens: list[int] = []
    at_kill = 0
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            tokens += json.loads(line[6:])["choices"][0].get("token_ids", [])
            if kill_pid is not None and tokens:
                os.kill(kill_pid, signal.SIGKILL)  # a child of the server this test started
                kill_pid, at_kill = None, len(tokens)
    return tokens, at_kill


def test_a_worker_killed_mid_stream_resumes_a_run_time_adapters_request_exactly(
    server: Server, adapters: dict[str, Path], loaded: dict[str, Path]
) -> None:
    assert load(server, loaded, "wide", adapters["wide"]).status_code == 200
    assert load(server, loaded, "late", adapters["narrow"]).status_code == 200
    undisturbed, _ = stream_tokens(server, "late")
    (worker,) = [a for a in server.admin("actors") if a["name"] == "worker0"]
    resumed, at_kill = stream_tokens(server, "late", kill_pid=worker["pid"])
    assert 0 < at_kill < len(resumed) // 2, "the kill came too late to test anything"
    assert resumed == undisturbed

    def restarted() -> bool:
        (now,) = [a for a in server.admin("actors") if a["name"] == "worker0"]
        return bool(now["restarts"] > worker["restarts"] and server.admin("health")["ready"])

    wait_until(restarted, timeout=60)
    # The restarted worker has every adapter the root serves, loaded when a request needs it.
    with server.http() as http:
        assert completion(http, "late", 8) == undisturbed[:8]
        assert (
            completion(http, "wide", 8)
            == peft_greedy(tiny_checkpoint(), adapters["wide"], PROMPT, 8)[0]
        )
