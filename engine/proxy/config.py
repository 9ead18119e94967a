"""What `engine proxy` is told on its command line (engine/cli/proxy_cmd.py reads it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProxyConfig:
    prefill: tuple[str, ...]  # instance base URLs, scheme://host:port[/prefix], no trailing /
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    connect_timeout: float = 2.0  # seconds to open a connection to an instance
    first_byte_timeout: float = 30.0  # seconds to a stream's first event (or a prefill's answer)
    read_timeout: float = 600.0  # seconds between two chunks of a stream; a whole other answer
    probe_interval: float = 1.0  # seconds between probes of each instance's /ready (up or down)
    probe_timeout: float = 1.0
    probe_failures: int = 3  # failed probes in a row that take an instance out of rotation
    max_request_bytes: int = 64 * 1024 * 1024
    drain_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    log_level: str = "info"
    # 'Authorization: Bearer KEY' required on every route but /health, /ready and /metrics;
    # /health/instances (URLs, last errors) is only for holders of the key. None: no check.
    api_key: str | None = None
