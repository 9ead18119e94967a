"""Command line: `serve` (the default), `proxy`, `config show`, `admin`, `replay`, `trace import`,
`export`, `bench`.

Usage errors print one line to stderr and exit 2; invalid settings exit 2 the same way.
"""

from __future__ import annotations

import os
import sys

from engine.settings import SettingsError

USAGE = """\
usage: engine serve [MODEL] [flags]   (or python -m engine [serve] ...)  start the server
       (MODEL: a checkpoint directory, a .gguf file, 'demo' for the random-weight demo model, or a
        Hugging Face repo id found in the local HF cache; none: SmolLM2-135M-Instruct)
       python -m engine proxy --prefill URL [URL ...] --decode URL [URL ...] [--port N]
           [--host H]   the P/D front over prefill and decode instances (proxy --help)
       python -m engine config show [flags] [--json]  effective settings and their sources
       python -m engine admin [--socket PATH] COMMAND [ARGS] [--json]
           COMMAND: health | stats | actors | requests | abort ID | drain | shutdown |
                    log-level LEVEL | models | load MODEL | unload MODEL | tenants |
                    reload-tenants
       python -m engine replay TRACE --url URL [--speed X] [--max-concurrency N] [--limit N]
           [--model NAME] [--compare] [--json] [--plot OUT.png]   re-send a trace, report
       python -m engine trace import mooncake|azure|poisson ... -o OUT   make a trace
       python -m engine export FILE.gguf|default DIR   a GGUF model as a float32 HF checkpoint
       python -m engine bench serve|offline|step [flags]   the engine's benchmarks (bench --help)
       python -m engine tenants key [--stdin]   an API key and its line for --api-keys-file
"""


def console_main() -> int:
    """The `engine` console script."""
    return main(sys.argv[1:])


def main(argv: list[str]) -> int:
    command, rest = _split_command(argv)
    try:
        if command == "help":
            _print_help()
            return 0
        if command == "config":
            from engine.cli.config_cmd import run_config

            return run_config(rest, os.environ)
        if command == "proxy":
            from engine.cli.proxy_cmd import run_proxy

            return run_proxy(rest, os.environ)
        if command == "admin":
            from engine.cli.admin_client import run_admin

            return run_admin(rest, os.environ)
        if command == "replay":
            from engine.cli.replay_cmd import run_replay

            return run_replay(rest, os.environ)
        if command == "trace":
            from engine.cli.trace_cmd import run_trace

            return run_trace(rest, os.environ)
        if command == "export":
            from engine.cli.export_cmd import run_export

            return run_export(rest, os.environ)
        if command == "tenants":
            from engine.cli.tenants_cmd import run_tenants

            return run_tenants(rest)
        if command == "bench":
            from engine.cli.bench_cmd import run_bench

            return run_bench(rest)
        if any(a in ("-h", "--help") for a in rest):
            _print_help()
            return 0
        from engine.cli.serve import run_serve

        return run_serve(rest, os.environ)
    except SettingsError as e:
        print(f"engine: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _split_command(argv: list[str]) -> tuple[str, list[str]]:
    if argv and argv[0] in (
        "serve",
        "proxy",
        "config",
        "admin",
        "replay",
        "trace",
        "export",
        "bench",
        "tenants",
        "help",
    ):
        return argv[0], argv[1:]
    return "serve", argv


def _print_help() -> None:
    from engine.settings.describe import settings_help

    print(USAGE)
    print(settings_help())
