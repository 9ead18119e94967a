"""`engine bench serve|offline|step`: the engine's benchmarks, as vLLM's `vllm bench serve`: thin
entries over engine/bench/, whose code tools/bench/ also runs (with the peers beside it)."""

from __future__ import annotations

import sys

USAGE = """\
usage: engine bench serve [flags]     online serving: streams, Poisson rates or a trace window
       engine bench offline [flags]   a batch of requests through the library, end to end
       engine bench step [flags]      static batches through the raw model: prefill, decode
(engine bench COMMAND --help for its flags)"""


def run_bench(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from engine.bench.serve import main

        return main(rest)
    if command == "offline":
        from engine.bench.offline import main as offline

        return offline(rest)
    if command == "step":
        from engine.model.placement.policy import sleeping_openmp_threads

        sleeping_openmp_threads()  # as the engine's workers do; before torch loads OpenMP
        from engine.bench.step import main as step

        return step(rest)
    print(f"engine bench: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2
