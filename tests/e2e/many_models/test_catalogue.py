"""Many models in one server (issue 48): a command-line model, a Hugging Face directory and a
GGUF file of a --models-dir, loaded on their first request, each answering as transformers
does on its checkpoint; a fourth model over --max-loaded-models unloads the least recently used
idle one; keep_alive 0 unloads after the answer, its processes and shared memory gone; a model
that fails to load fails alone; a SIGKILLed worker of one model restarts that model alone while
the streams of both models finish exactly. One server for the module, its prompts held in
flight by tests/holds.py where a test acts on a running request."""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.checkpoints import assert_same_greedy, hf_greedy
from tests.e2e.harness import Server, wait_until
from tests.holds import held

# A load takes seconds, and more on a busy machine: the clients wait for loads this long.
LOADS_S = 600.0
PROMPT = held([(7 * i + 11) % 500 for i in range(24)])


def completion(http: httpx.Client, model: str, **extra: Any) -> list[int]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
    reply = http.post("/v1/completions", json=body | {"return_token_ids": True} | extra)
    assert reply.status_code == 200, reply.text
    return list(reply.json()["choices"][0]["token_ids"])


def states(server: Server) -> dict[str, str]:
    with server.http(timeout=LOADS_S) as http:
        cards = http.get("/v1/models").json()["data"]
    return {card["id"]: card["status"]["value"] for card in cards}


def model_pids(server: Server, model: str) -> set[int]:
    return {row["pid"] for row in server.admin("actors") if row["model"] == model and row["pid"]}


def test_each_model_loads_on_its_first_request_and_answers_as_transformers(
    models: Server, checkpoints: dict[str, Path]
) -> None:
    assert states(models) == {
        "main": "loaded",
        "llama": "unloaded",
        "llama:tiny": "unloaded",  # llama's alias, listed as vLLM lists every served name
        "llama-q8": "unloaded",
        "qwen2": "unloaded",
        "broken": "unloaded",
    }
    with models.http(timeout=LOADS_S) as http:
        # Two models at once: each request waits for its own model's load.
        with ThreadPoolExecutor(3) as pool:
            names = ["main", "llama:tiny", "llama-q8"]
            answers = list(pool.map(lambda name: completion(http, name), names))
        for name, tokens in zip(["main", "llama", "llama-q8"], answers, strict=True):
            assert_same_greedy(tokens, hf_greedy(checkpoints[name], PROMPT, 8))
        # Loaded now: the same tokens again, batched with the other models' requests.
        with ThreadPoolExecutor(3) as pool:
            assert list(pool.map(lambda name: completion(http, name), names)) == answers
    assert states(models)["llama"] == "loaded"


def test_a_model_that_fails_to_load_fails_alone(models: Server) -> None:
    with models.http(timeout=LOADS_S) as http:
        reply = http.post("/v1/completions", json={"model": "broken", "prompt": "hi"})
        assert reply.status_code == 503
        message = reply.json()["error"]["message"]
        assert "broken" in message and "NoSuchForCausalLM" in message
        assert completion(http, "main")  # the others serve on
    assert states(models)["broken"] == "failed"


def test_a_fourth_model_unloads_the_least_recently_used_idle_one(models: Server) -> None:
    with models.http(timeout=LOADS_S) as http:
        for name in ("llama-q8", "llama", "main"):  # llama-q8: the least recently used
            completion(http, name)
        gone = model_pids(models, "llama-q8")
        assert gone
        answer = completion(http, "qwen2")
    now = states(models)
    assert now["qwen2"] == now["llama"] == now["main"] == "loaded"
    assert now["llama-q8"] == "unloaded"
    assert not any(_alive(pid) for pid in gone)

    # The catalogue's metrics, and the request metrics of each model under its own name (an
    # alias's requests, two to llama:tiny before, under its model's).
    figures = _metrics(models)
    assert figures["engine:loaded_models"][()] == 3
    loaded = figures["engine:model_loaded"]
    assert loaded[("main",)] == loaded[("llama",)] == loaded[("qwen2",)] == 1
    assert loaded[("llama-q8",)] == loaded[("broken",)] == 0
    assert figures["engine:model_loads_total"][("llama-q8",)] == 1
    assert figures["engine:model_unloads_total"][("llama-q8",)] == 1
    assert figures["engine:model_load_seconds_total"][("qwen2",)] > 0
    memory = figures["engine:model_memory_bytes"]
    assert memory[("qwen2",)] > 0 and memory[("llama-q8",)] == 0
    weights = {labels[0] for labels in figures["engine:model_weight_bytes"]}
    assert weights == {"main", "llama", "qwen2"}  # every engine figure, per loaded model
    requests = figures["engine:http_requests_total"]
    assert requests[("llama", "completions", "success")] == 3
    assert requests[("qwen2", "completions", "success")] == 1
    assert figures["engine:generation_tokens_total"][("qwen2",)] == len(answer)


def test_keep_alive_0_unloads_after_the_answer_and_returns_its_memory(models: Server) -> None:
    with models.http(timeout=LOADS_S) as http:
        completion(http, "qwen2")
        pids = model_pids(models, "qwen2")
        run_dir = _run_directory(models.proc.pid)
        segments = {p.name for p in run_dir.iterdir()}
        body = {"model": "qwen2", "prompt": "hi", "stream": False, "keep_alive": 0}
        body["options"] = {"num_predict": 2}
        reply = http.post("/api/generate", json=body)
        assert reply.status_code == 200 and reply.json()["done"], reply.text
    wait_until(lambda: states(models)["qwen2"] == "unloaded", timeout=60)
    assert not any(_alive(pid) for pid in pids)
    left = {p.name for p in run_dir.iterdir()} if run_dir.exists() else set()
    assert left < segments, "the unloaded model's segments are still there"


def test_a_model_with_requests_in_flight_is_unloaded_only_after_them(models: Server) -> None:
    body = {"model": "llama", "prompt": PROMPT, "max_tokens": 60, "temperature": 0.0}
    body["ignore_eos"] = True
    with models.http(timeout=LOADS_S) as http, ThreadPoolExecutor(2) as pool:
        running = pool.submit(http.post, "/v1/completions", json=body)
        wait_until(lambda: any(r["model"] == "llama" for r in models.admin("requests")))
        unloading = pool.submit(http.post, "/models/unload", json={"model": "llama"})
        reply = running.result(timeout=LOADS_S)
        assert reply.status_code == 200
        assert reply.json()["choices"][0]["finish_reason"] == "length"
        assert unloading.result(timeout=LOADS_S).status_code == 200
    assert states(models)["llama"] == "unloaded"


def test_a_killed_worker_restarts_its_model_alone_and_both_streams_finish_exactly(
    models: Server,
) -> None:
    with models.http(timeout=LOADS_S) as http:
        assert http.post("/models/load", json={"model": "llama"}).status_code == 200
    undisturbed = {name: _stream(models, name) for name in ("main", "llama")}
    before = {row["name"] + "@" + row["model"]: row["restarts"] for row in models.admin("actors")}
    (worker,) = [
        r for r in models.admin("actors") if r["model"] == "llama" and r["role"] == "worker"
    ]
    with ThreadPoolExecutor(2) as pool:
        main = pool.submit(_stream, models, "main")
        llama = pool.submit(_stream, models, "llama", worker["pid"])
        assert main.result(timeout=LOADS_S) == undisturbed["main"]
        assert llama.result(timeout=LOADS_S) == undisturbed["llama"]
    after = {row["name"] + "@" + row["model"]: row["restarts"] for row in models.admin("actors")}
    restarted = {name for name, count in after.items() if count > before.get(name, 0)}
    assert restarted == {worker["name"] + "@llama"}


def _stream(server: Server, model: str, kill_pid: int | None = None) -> list[int]:
    """A streamed greedy completion's token ids; `kill_pid` SIGKILLed once the first came."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 60, "temperature": 0.0}
    body |= {"ignore_eos": True, "stream": True, "return_token_ids": True}
    tokens: list[int] = []
    with (
        server.http(timeout=LOADS_S) as http,
        http.stream("POST", "/v1/completions", json=body) as reply,
    ):
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                tokens += json.loads(line[6:])["choices"][0].get("token_ids", [])
                if kill_pid is not None and tokens:
                    os.kill(kill_pid, signal.SIGKILL)  # a child of the server this test started
                    kill_pid = None
    return tokens


def _metrics(server: Server) -> dict[str, dict[tuple[str, ...], float]]:
    """/metrics: each sample's value by name and label values (model_name first)."""
    with server.http() as http:
        text = http.get("/metrics").text
    found: dict[str, dict[tuple[str, ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            model = [labels.pop("model_name")] if "model_name" in labels else []
            found.setdefault(sample.name, {})[(*model, *labels.values())] = sample.value
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _run_directory(pid: int) -> Path:
    (found,) = [p for p in Path("/dev/shm").iterdir() if p.name.startswith(f"engine-{pid}-")]
    return found
