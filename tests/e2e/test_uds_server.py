"""`--uds`: the API on a Unix socket instead of host:port (with --root-path, as behind a
path-based proxy), the socket removed at exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from tests.e2e.conftest import server_args
from tests.e2e.harness import API_KEY, REPO, START_TIMEOUT_S, read_line_starting, stop_process


def test_the_api_serves_on_a_unix_socket(model_args: list[str], tmp_path: Path) -> None:
    uds = tmp_path / "api.sock"
    args = server_args(
        model_args, tmp_path / "admin.sock", "--uds", str(uds), "--root-path", "/api"
    )
    with open(tmp_path / "uds.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine", "serve", *args],
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    try:
        line = read_line_starting(proc, "engine ready:", START_TIMEOUT_S)
        assert line.startswith(f"engine ready: unix:{uds} ")
        transport = httpx.HTTPTransport(uds=str(uds))
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.Client(transport=transport, base_url="http://engine", headers=headers) as http:
            assert http.get("/ready").status_code == 200
            # a proxy that routes /api/... here strips the prefix; root_path is what it was
            models = http.get("/v1/models")
            done = http.post("/v1/completions", json={"prompt": "over uds", "max_tokens": 2})
        assert models.status_code == 200 and models.json()["data"]
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] >= 1
    finally:
        assert stop_process(proc, 60) == 0
    assert not uds.exists()
