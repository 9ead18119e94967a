"""The [kv_transfer] section of the settings schema: prefill/decode disaggregation.

Two ways to disaggregate:
- one launch: `prefill_replicas` P and `decode_replicas` D (both >= 1) run P + D replicas on
  this host; the root routes each request to a prefill replica, then on to a decode replica;
- several launches: `role` prefill or decode makes this instance one side, and `engine proxy`
  routes between instances over HTTP.

Security (engine/kv/transfer/secret.py, handshake.py, signing.py, tls.py): every kv_transfer
connection proves the deployment secret, a prefill instance signs the kv_transfer_params it
hands out, a decode instance pulls only from `peers`; the secret itself is never a setting.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Literal

from msgspec import Meta

from engine.settings.section import Section


class KvTransferSettings(Section, frozen=True):
    role: Annotated[
        Literal["both", "prefill", "decode"],
        Meta(description="this instance's part: both (colocated), prefill or decode"),
    ] = "both"
    prefill_replicas: Annotated[
        int, Meta(ge=0, le=64, description="one-launch P/D: replicas that only prefill")
    ] = 0
    decode_replicas: Annotated[
        int, Meta(ge=0, le=64, description="one-launch P/D: replicas that decode")
    ] = 0
    host: Annotated[
        str, Meta(min_length=1, description="address the kv_transfer actors listen on")
    ] = "127.0.0.1"
    port: Annotated[
        int,
        Meta(ge=0, le=65535, description="kv_transfer port of rank 0 (rank r: +r); 0 = any free"),
    ] = 0
    advertise_host: Annotated[
        str | None,
        Meta(description="the address pullers are told to connect to (default: host)"),
    ] = None
    hold_timeout: Annotated[
        float,
        Meta(
            gt=0.0,
            description="seconds a prefill instance keeps a handed-off request's KV blocks for "
            "a puller that has not acknowledged them",
        ),
    ] = 30.0
    transport: Annotated[
        Literal["auto", "tcp"],
        Meta(description="auto: shared memory between processes of one host, else TCP; tcp: TCP"),
    ] = "auto"
    secret_file: Annotated[
        str | None,
        Meta(
            description="file holding the deployment secret every kv_transfer connection "
            "proves and that signs kv_transfer_params (or set ENGINE_KV_SECRET; default: "
            "<engine home>/kv_transfer.secret, created if missing; one-launch P/D makes its own)"
        ),
    ] = None
    peers: Annotated[
        tuple[str, ...],
        Meta(
            description="the hosts (or host:port, or networks such as 10.244.0.0/16: a "
            "cluster's pod network) a decode instance pulls KV from; kv_transfer_params naming "
            "any other are refused"
        ),
    ] = ("127.0.0.1", "localhost", "::1")
    params_ttl: Annotated[
        float,
        Meta(
            gt=0.0,
            description="seconds the kv_transfer_params a prefill instance signs stay valid "
            "(a decode instance refuses them afterwards)",
        ),
    ] = 300.0
    tls_cert: Annotated[
        str | None,
        Meta(description="certificate (PEM) for TLS between kv_transfer actors; see tls_ca"),
    ] = None
    tls_key: Annotated[str | None, Meta(description="private key (PEM) of tls_cert")] = None
    tls_ca: Annotated[
        str | None,
        Meta(description="CA (PEM) that signed every kv_transfer actor's certificate"),
    ] = None


def kv_transfer_problems(settings: object) -> list[tuple[str, str]]:
    """Invalid combinations, as (the setting at fault, what is wrong with it)."""
    kv = settings.kv_transfer  # type: ignore[attr-defined]
    parallel = settings.parallel  # type: ignore[attr-defined]
    problems = []
    one_launch = kv.prefill_replicas or kv.decode_replicas
    if one_launch and not (kv.prefill_replicas and kv.decode_replicas):
        missing, given = ("decode", "prefill") if kv.prefill_replicas else ("prefill", "decode")
        problems.append(
            (
                f"kv_transfer.{missing}_replicas",
                f"must be at least 1 when kv_transfer.{given}_replicas is set (one-launch P/D "
                f"needs both roles), got 0",
            )
        )
    if one_launch and kv.role != "both":
        problems.append(
            (
                "kv_transfer.role",
                f"must be both with kv_transfer.prefill_replicas/decode_replicas (one launch runs "
                f"both roles), got {kv.role}",
            )
        )
    if one_launch and parallel.data_parallel_size != 1:
        problems.append(
            (
                "parallel.data_parallel_size",
                f"must be 1 with kv_transfer.prefill_replicas/decode_replicas (they set the "
                f"replicas), got {parallel.data_parallel_size}",
            )
        )
    disaggregated = one_launch or kv.role != "both"
    if disaggregated and parallel.nnodes != 1:
        problems.append(
            (
                "parallel.nnodes",
                f"must be 1 with P/D disaggregation (an instance's ranks on one host), got "
                f"{parallel.nnodes}",
            )
        )
    for peer in kv.peers:
        if "/" in peer and not _is_network(peer):
            problems.append(
                (
                    "kv_transfer.peers",
                    f"{peer!r} is neither a host nor a network such as 10.244.0.0/16",
                )
            )
    if disaggregated and not settings.cache.enable_prefix_caching:  # type: ignore[attr-defined]
        problems.append(
            (
                "cache.enable_prefix_caching",
                "must be true with P/D disaggregation (pulled KV blocks enter the decode side's "
                "prefix cache), got false",
            )
        )
    return problems


def _is_network(text: str) -> bool:
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        return False
    return True
