"""The kv_transfer actor's settings, built by whoever plans an instance (one per worker rank)."""

from __future__ import annotations

import msgspec

from engine.messages.kv_transfer import KvLayout


class KvTransferConfig(msgspec.Struct, frozen=True, kw_only=True):
    rank: int
    layout: KvLayout  # this rank's cache, as the worker lays it out in the segment
    cache_segment: str  # logical name of the cache's SegmentDecl (self.segments[name])
    listen_host: str = "127.0.0.1"
    port_base: int = 0  # 0: an ephemeral port; else port_base + rank (multi-host: known ports)
    advertised_host: str = ""  # what pullers connect to; "" means listen_host
    force_tcp: bool = False  # pull over TCP even from a same-host source (tests, benchmarks)
    idle_timeout: float = 30.0  # a connection with no request for this long is closed
    # The deployment secret (engine/kv_transfer/secret.py); b"": this user's secret file in the
    # default engine home, as an instance started with --kv-role finds it.
    secret: bytes = b""
    tls_cert: str = ""  # all three set: connections run inside TLS (engine/kv_transfer/tls.py)
    tls_key: str = ""
    tls_ca: str = ""

    @property
    def port(self) -> int:
        return self.port_base + self.rank if self.port_base else 0

    def __repr__(self) -> str:  # the secret never reaches a log line
        return f"KvTransferConfig(rank={self.rank}, port={self.port}, secret=<redacted>)"
