"""`engine bench serve`: the engine's benchmarks, as vLLM's `vllm bench serve`: thin entries over
engine/bench/, whose code tools/bench/ also runs (with the peers beside it)."""

from __future__ import annotations

import sys

USAGE = """\
usage: engine bench serve [flags]     online serving: streams, Poisson rates or a trace window
(engine bench COMMAND --help for its flags)"""


def run_bench(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from engine.bench.serve import main

        return main(rest)
    print(f"engine bench: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2
