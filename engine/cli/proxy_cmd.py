"""`engine proxy --prefill URL [URL ...] --decode URL [URL ...] [--port N] [--host H] ...`.

Bad arguments end the command with status 2 and one line naming what was wrong.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

from engine.proxy.config import ProxyConfig
from engine.settings.api_key import COMMAND_LINE_WARNING, ApiKeyFileError, read_api_key_file

LOG_LEVELS = ("debug", "info", "warning", "error")


class ProxyUsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ProxyUsageError(message)


def _parser() -> _Parser:
    defaults = ProxyConfig(prefill=(), decode=())
    p = _Parser(
        prog="engine proxy",
        description="OpenAI-compatible front for prefill and decode instances (P/D).",
        # A flag renamed in a new version must fail in old scripts and manifests, not be taken
        # as the abbreviation of another one.
        allow_abbrev=False,
    )
    for role in ("prefill", "decode"):
        p.add_argument(
            f"--{role}",
            nargs="+",
            action="extend",
            default=[],
            metavar="URL",
            help=f"base URL of a {role} instance (engine serve --kv-role {role}), e.g. "
            "http://10.0.0.5:8000; at least one",
        )
    p.add_argument("--host", default=defaults.host, help="address to listen on")
    p.add_argument("--port", type=int, default=defaults.port, help="0: any free port")
    _add_timeouts(p, defaults)
    p.add_argument(
        "--probe-failures",
        type=int,
        default=defaults.probe_failures,
        help="failed probes in a row that take an instance out of rotation (one good probe "
        "brings it back)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=defaults.max_request_bytes,
        help="larger request bodies are answered 413",
    )
    p.add_argument("--log-level", choices=LOG_LEVELS, default=defaults.log_level)
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health, /ready and "
        "/metrics; /health/instances names instances and their errors. Every local user can "
        "read a command line: pass the key as env ENGINE_API_KEY or --api-key-file instead",
    )
    p.add_argument("--api-key-file", default=None, help="read the API key from this file")
    return p


def _add_timeouts(p: _Parser, defaults: ProxyConfig) -> None:
    """The proxy's waits, in seconds: on instances, their probes, and the drain."""
    seconds = [
        ("--connect-timeout", defaults.connect_timeout, "to open a connection to an instance"),
        (
            "--first-byte-timeout",
            defaults.first_byte_timeout,
            "to a stream's first event or a prefill's answer (past it: a failure, like a probe's)",
        ),
        (
            "--read-timeout",
            defaults.read_timeout,
            "between two chunks of a stream, and for a whole non-streamed answer",
        ),
        ("--probe-interval", defaults.probe_interval, "between probes of each instance"),
        ("--probe-timeout", defaults.probe_timeout, "for one probe of an instance's /ready"),
        ("--drain-timeout", defaults.drain_timeout, "in-flight requests get after SIGTERM"),
    ]
    for flag, default, what in seconds:
        p.add_argument(flag, type=float, default=default, help=f"seconds {what}")


def instance_url(text: str, flag: str) -> str:
    """An instance's base URL, without a trailing slash; an error naming the flag otherwise."""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https"):
        raise ProxyUsageError(f"{flag} {text!r}: an instance URL starts with http:// or https://")
    if not parts.hostname:
        raise ProxyUsageError(f"{flag} {text!r}: the URL names no host")
    if parts.query or parts.fragment:
        raise ProxyUsageError(f"{flag} {text!r}: an instance URL has no query or fragment")
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number in range)
    except ValueError:
        raise ProxyUsageError(f"{flag} {text!r}: the port is not a number in [0, 65535]") from None
    return text.rstrip("/")


def _instances(urls: Sequence[str], flag: str) -> tuple[str, ...]:
    if not urls:
        role = flag.removeprefix("--")
        raise ProxyUsageError(f"no {role} instance: give at least one with {flag} URL")
    found = tuple(instance_url(u, flag) for u in urls)
    repeated = sorted({u for u in found if found.count(u) > 1})
    if repeated:
        raise ProxyUsageError(f"{flag} names {', '.join(repeated)} more than once")
    return found


def _api_key(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """The key from --api-key-file, --api-key (with a warning) or ENGINE_API_KEY."""
    if args.api_key is not None and args.api_key_file is not None:
        raise ProxyUsageError("give the API key one way: --api-key or --api-key-file")
    if args.api_key_file is not None:
        try:
            return read_api_key_file(args.api_key_file)
        except ApiKeyFileError as exc:
            raise ProxyUsageError(str(exc)) from None
    if args.api_key is not None:
        print(COMMAND_LINE_WARNING, file=sys.stderr)
    api_key = args.api_key if args.api_key is not None else environ.get("ENGINE_API_KEY")
    if api_key is not None and not api_key:
        raise ProxyUsageError("--api-key must not be empty")
    return api_key


def parse_proxy_args(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> ProxyConfig:
    args = _parser().parse_args(list(argv))
    api_key = _api_key(args, environ or {})
    if not 0 <= args.port <= 65535:
        raise ProxyUsageError(f"--port {args.port}: must be in [0, 65535]")
    timeouts = ("connect_timeout", "first_byte_timeout", "read_timeout")
    for flag in (*timeouts, "probe_interval", "probe_timeout"):
        if not getattr(args, flag) > 0:
            raise ProxyUsageError(f"--{flag.replace('_', '-')} must be > 0 seconds")
    if args.drain_timeout < 0:
        raise ProxyUsageError("--drain-timeout must be >= 0 seconds")
    if args.probe_failures < 1:
        raise ProxyUsageError("--probe-failures must be >= 1")
    if args.max_request_bytes < 1:
        raise ProxyUsageError("--max-request-bytes must be >= 1")
    return ProxyConfig(
        prefill=_instances(args.prefill, "--prefill"),
        decode=_instances(args.decode, "--decode"),
        host=args.host,
        port=args.port,
        connect_timeout=args.connect_timeout,
        first_byte_timeout=args.first_byte_timeout,
        read_timeout=args.read_timeout,
        probe_interval=args.probe_interval,
        probe_timeout=args.probe_timeout,
        probe_failures=args.probe_failures,
        max_request_bytes=args.max_request_bytes,
        drain_timeout=args.drain_timeout,
        log_level=args.log_level,
        api_key=api_key,
    )


def run_proxy(argv: list[str], environ: Mapping[str, str]) -> int:
    try:
        config = parse_proxy_args(argv, environ)
    except ProxyUsageError as e:
        print(f"engine proxy: {e}", file=sys.stderr)
        return 2
    from engine.proxy.server import serve_proxy

    return serve_proxy(config)
