"""Where the vLLM-CPU peer lives (PEERS.md): its interpreter, found or explained.

Shared by the tools that measure the engine beside vLLM (bench_offline, bench_serving).
"""

from __future__ import annotations

import os

DEFAULT_VLLM_PYTHON = "~/vllm-peer/bin/python"


def vllm_python(path: str) -> str:
    """The peer's interpreter, `~` expanded; exits naming it when it is not installed."""
    python = os.path.expanduser(path)
    if not os.path.exists(python):
        raise SystemExit(f"--vllm-python {python} does not exist; PEERS.md shows how to install it")
    return python
