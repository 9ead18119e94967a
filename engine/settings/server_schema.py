"""The [server] section of the settings schema (engine/settings/schema.py): the HTTP server."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from engine.settings.section import BYTES_UNIT, Section


class ServerSettings(Section, frozen=True):
    host: Annotated[str, Meta(min_length=1, description="address the HTTP server binds")] = (
        "127.0.0.1"
    )
    port: Annotated[
        int, Meta(ge=0, le=65535, description="HTTP port; 0 = any free port (printed at start)")
    ] = 8000
    api_key: Annotated[
        str | None,
        Meta(
            description="require 'Authorization: Bearer KEY'; pass it as env ENGINE_API_KEY "
            "or --api-key-file (on the command line every local user can read it)"
        ),
    ] = None
    api_key_file: Annotated[
        str | None,
        Meta(description="read server.api_key from this file (its first line)"),
    ] = None
    api_keys_file: Annotated[
        str | None,
        Meta(
            description="tenants: a TOML file with a key (as its SHA-256) per tenant, its "
            "weight, quotas, models and priority ceiling (docs/tenants.md); reloaded on SIGHUP"
        ),
    ] = None
    max_request_bytes: Annotated[
        int, Meta(ge=1, description="largest request body accepted (bigger: 413)", extra=BYTES_UNIT)
    ] = 4 * 1024 * 1024
    drain_timeout: Annotated[
        float, Meta(ge=0.0, description="seconds in-flight requests get to finish on shutdown")
    ] = 30.0
    record_trace: Annotated[
        str | None,
        Meta(description="append each request's arrival, sizes and timings to this .jsonl file"),
    ] = None
    stream_buffer: Annotated[
        int,
        Meta(
            ge=1,
            description="outputs buffered per request for a client that is not reading; more "
            "are merged into the last one",
        ),
    ] = 64
    stalled_stream_timeout: Annotated[
        float,
        Meta(
            gt=0.0,
            description="seconds a client may leave a full stream buffer unread before its "
            "request is aborted",
        ),
    ] = 60.0
    send_buffer: Annotated[
        int,
        Meta(
            ge=0,
            description="kernel send buffer of each HTTP connection (SO_SNDBUF): bounds what a "
            "client that stops reading holds and lets its stall be seen on any host; 0 = the "
            "kernel's autotuning (up to net.ipv4.tcp_wmem's maximum)",
            extra=BYTES_UNIT,
        ),
    ] = 256 * 1024
    allow_special_tokens_in_chat: Annotated[
        bool,
        Meta(
            description="tokenize special tokens written in chat message contents as control "
            "tokens (trusted clients only); off: as plain text",
        ),
    ] = False
    header_timeout: Annotated[
        float,
        Meta(
            gt=0.0,
            description="seconds a connection gets to send a complete request head; then "
            "it is answered 408 and closed",
        ),
    ] = 10.0
    body_timeout: Annotated[
        float,
        Meta(
            gt=0.0,
            description="seconds a request gets to send its whole body after its head; then "
            "it is answered 408 and closed",
        ),
    ] = 60.0
    max_connections: Annotated[
        int,
        Meta(ge=1, description="open HTTP connections; one more is answered 503 and closed"),
    ] = 2048
    max_connections_per_client: (
        Annotated[
            int,
            Meta(
                ge=1,
                description="open HTTP connections from one peer address, below "
                "max_connections, so that one client cannot take the server (and /health, "
                "/ready) from the others; unset = an eighth of max_connections",
            ),
        ]
        | None
    ) = None
    uds: Annotated[
        str | None,
        Meta(description="serve HTTP on this Unix socket path instead of host:port"),
    ] = None
    root_path: Annotated[
        str, Meta(description="ASGI root_path, for a server behind a path-based proxy")
    ] = ""
    pidfile: Annotated[
        str | None,
        Meta(
            description="write the root's pid here and hold it locked while it runs: a second "
            "engine on the same file is refused (for a service manager such as systemd)"
        ),
    ] = None
    enable_log_requests: Annotated[
        bool,
        Meta(description="log one line per request: id, sizes, parameters, outcome, timings"),
    ] = False
    max_log_len: (
        Annotated[
            int,
            Meta(ge=0, description="prompt characters a request's log line shows; unset = all"),
        ]
        | None
    ) = None
    disable_log_stats: Annotated[
        bool, Meta(description="no throughput / queue / KV cache line every 10 seconds")
    ] = False
    allowed_origins: Annotated[
        tuple[str, ...],
        Meta(
            description="CORS: origins browsers may call from (e.g. '[\"*\"]' or "
            "'https://a.example,https://b.example'); unset = no CORS"
        ),
    ] = ()
    allowed_methods: Annotated[
        tuple[str, ...], Meta(description="CORS: methods allowed (with allowed_origins)")
    ] = ("*",)
    allowed_headers: Annotated[
        tuple[str, ...], Meta(description="CORS: request headers allowed (with allowed_origins)")
    ] = ("*",)
    allow_credentials: Annotated[
        bool, Meta(description="CORS: allow cookies and credentials (with allowed_origins)")
    ] = False
    responses_store_size: Annotated[
        int,
        Meta(
            ge=0,
            description="finished /v1/responses answers kept in memory for previous_response_id "
            "(least recently used dropped first); 0 = none kept",
        ),
    ] = 1000
    tool_call_parser: Annotated[
        Literal["hermes", "llama3_json"] | None,
        Meta(
            description="how tool calls are read from a chat answer with tool_choice 'auto': "
            "hermes (<tool_call>{...}</tool_call>, Qwen) or llama3_json; unset: not read"
        ),
    ] = None
    reasoning_parser: Annotated[
        Literal["qwen3"] | None,
        Meta(description="qwen3: a chat answer's <think>...</think> is its reasoning_content"),
    ] = None
    otlp_traces_endpoint: Annotated[
        str | None,
        Meta(
            description="export one OpenTelemetry span per request to this OTLP/HTTP URL "
            "(e.g. http://localhost:4318/v1/traces); needs the extra engine[otel]"
        ),
    ] = None
    ui: Annotated[
        bool,
        Meta(description="serve the chat page at GET / (--no-ui: the API alone)"),
    ] = True


def server_problems(server: ServerSettings) -> list[tuple[str, str]]:
    """The [server] section's rules between its fields, as schema.cross_field_problems says."""
    problems = []
    per_client = server.max_connections_per_client
    if per_client is not None and per_client >= server.max_connections:
        problems.append(
            (
                "server.max_connections_per_client",
                f"must be below server.max_connections ({server.max_connections}) so that one "
                f"client cannot take every connection, got {per_client}",
            )
        )
    if server.api_key is not None and server.api_key_file is not None:
        problems.append(
            (
                "server.api_key_file",
                "give the API key one way: server.api_key (ENGINE_API_KEY) or server.api_key_file",
            )
        )
    if server.api_keys_file is not None and (server.api_key or server.api_key_file):
        problems.append(
            (
                "server.api_keys_file",
                "give either one API key (server.api_key, server.api_key_file) or a tenants "
                "file with a key per tenant, not both",
            )
        )
    return problems
