"""vLLM-CPU as a peer (docs/benchmarks.md, Peers): its interpreter, found or explained, and its
OpenAI server started with the settings it is measured with.

Shared by the tools that measure the engine beside vLLM (bench/offline.py, bench/serving.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from engine.client.process import free_port
from engine.client.servers import http_server

DEFAULT_VLLM_PYTHON = "~/vllm-peer/bin/python"


def vllm_python(path: str) -> str:
    """The peer's interpreter, `~` expanded; exits naming it when it is not installed."""
    python = os.path.expanduser(path)
    if not os.path.exists(python):
        raise SystemExit(
            f"--vllm-python {python} does not exist; docs/benchmarks.md (Peers) shows how to "
            "install it"
        )
    return python


@contextlib.contextmanager
def vllm_server(
    python: str, model: str, logs: Path, extra_args: list[str], start_timeout: float
) -> Iterator[str]:
    """vLLM's OpenAI server with the peer's settings (float32, eager, 30 % of memory); yields its
    URL once /v1/models answers (it prints no ready line of its own)."""
    port = free_port()
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--dtype",
        "float32",
        "--enforce-eager",
        "--gpu-memory-utilization",
        "0.3",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra_args,
    ]
    with http_server(cmd, "vLLM server", logs / "vllm.log", "/v1/models", start_timeout) as url:
        yield url
