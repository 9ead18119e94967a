"""`--uds`: the API on a Unix socket instead of host:port (with --root-path, as behind a
path-based proxy), owner-only, never taken from a live server, and removed at exit."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import httpx

from tests.e2e.conftest import server_args, without_api_key
from tests.e2e.harness import API_KEY, REPO, start_server


def test_the_api_serves_on_a_unix_socket(model_args: list[str], tmp_path: Path) -> None:
    uds = tmp_path / "api.sock"
    args = server_args(
        model_args, tmp_path / "admin.sock", "--uds", str(uds), "--root-path", "/api"
    )
    srv = start_server(args, tmp_path, name="uds")
    try:
        assert srv.url == f"unix:{uds}"
        assert stat.S_IMODE(uds.stat().st_mode) == 0o600  # owner-only, like the admin socket
        # A second server on the same path does not take the live socket away.
        second = subprocess.run(
            [sys.executable, "-m", "engine", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 1 and "a server is listening on" in second.stderr
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
        assert srv.stop(60) == 0
    assert not uds.exists()


def test_a_file_or_directory_at_the_socket_path_is_refused_not_removed(
    model_args: list[str], tmp_path: Path
) -> None:
    regular = tmp_path / "api.sock"
    regular.write_text("not a socket")
    directory = tmp_path / "dir.sock"
    directory.mkdir()
    for path in (regular, directory):
        args = without_api_key(server_args(model_args, tmp_path / "admin.sock", "--uds", str(path)))
        refused = subprocess.run(
            [sys.executable, "-m", "engine", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == 1
        lines = refused.stderr.strip().splitlines()
        assert lines == [
            f"engine: cannot listen on {path}: {path} exists and is not a socket; not removing it"
        ], refused.stderr
    assert regular.read_text() == "not a socket" and directory.is_dir()
