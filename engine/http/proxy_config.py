"""What `engine proxy` is told on its command line (engine/cli/proxy_cmd.py reads it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProxyConfig:
    prefill: tuple[str, ...]  # instance base URLs, scheme://host:port[/prefix], no trailing /
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    connect_timeout: float = 5.0  # seconds to open a connection to an instance
    read_timeout: float = 600.0  # seconds between two reads of an answer (a whole non-stream one)
    probe_interval: float = 2.0  # seconds between probes of down instances' /ready
    probe_timeout: float = 2.0
    max_request_bytes: int = 64 * 1024 * 1024
    drain_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    log_level: str = "info"
    # 'Authorization: Bearer KEY' required on every route but /health, /ready and /metrics;
    # /health/instances (URLs, last errors) is only for holders of the key. None: no check.
    api_key: str | None = None
