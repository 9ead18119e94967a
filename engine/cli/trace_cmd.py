"""`python -m engine trace import mooncake|azure|poisson ... -o OUT`: public traces and synthetic
workloads into the engine's trace format (replay them with `python -m engine replay OUT`).

Exit status: 0 imported (malformed rows are skipped and listed on stderr); 2 usage error or an
unusable source.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator, Mapping
from typing import IO, Literal

from engine.cli.replay_cmd import _positive_float, _positive_int
from engine.trace.format import write_trace
from engine.trace.importers import (
    MOONCAKE_BLOCK_TOKENS,
    ImportOptions,
    ImportResult,
    TraceImportError,
    import_azure,
    import_mooncake,
    poisson_workload,
)
from engine.trace.synth import PromptSynth, TokenRange

MAX_LISTED_PROBLEMS = 20


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine trace", description=__doc__.split("\n\n")[0])
    commands = p.add_subparsers(dest="command", required=True)
    imports = commands.add_parser("import", help="convert a public trace or make a workload")
    kinds = imports.add_subparsers(dest="kind", required=True)

    mooncake = kinds.add_parser(
        "mooncake", help="Mooncake JSONL (timestamp ms, input_length, output_length, hash_ids)"
    )
    mooncake.add_argument("source", help="Mooncake .jsonl file")
    mooncake.add_argument(
        "--block-tokens",
        type=_positive_int,
        default=MOONCAKE_BLOCK_TOKENS,
        help="tokens per hash_id block (default 512, the trace's own); input "
        "lengths scale by block-tokens/512 so the blocks still cover them",
    )
    azure = kinds.add_parser(
        "azure", help="Azure LLM inference CSV (TIMESTAMP, ContextTokens, GeneratedTokens)"
    )
    azure.add_argument("source", help="Azure .csv file")
    azure.add_argument(
        "--input-scale",
        type=_positive_float,
        default=1.0,
        help="multiply input lengths by this (default 1)",
    )
    poisson = kinds.add_parser("poisson", help="synthetic Poisson arrivals, fixed lengths")
    poisson.add_argument("--rate", type=_positive_float, required=True, help="requests per second")
    poisson.add_argument("--num", type=_positive_int, required=True, help="number of requests")
    poisson.add_argument("--input-len", type=_positive_int, required=True, help="prompt tokens")
    poisson.add_argument("--output-len", type=_positive_int, required=True, help="output tokens")
    for kind in (mooncake, azure, poisson):
        _common_options(kind)
    return p


def _common_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", default="-", help="trace file to write (default: stdout)")
    p.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="API to send to (chat needs --prompt-format text)",
    )
    p.add_argument(
        "--prompt-format",
        choices=("tokens", "text"),
        default="tokens",
        help="prompts as token ids (exact lengths) or words (approximate lengths)",
    )
    p.add_argument(
        "--token-range",
        type=_token_range,
        default=TokenRange(),
        help="LOW:HIGH, token ids drawn from [LOW, HIGH) (default 100:500)",
    )
    p.add_argument(
        "--max-input",
        type=_positive_int,
        default=None,
        help="cap prompt lengths (prefixes are kept)",
    )
    p.add_argument("--max-output", type=_positive_int, default=None, help="cap output lengths")
    p.add_argument(
        "--output-scale",
        type=_positive_float,
        default=1.0,
        help="multiply output lengths by this (default 1)",
    )
    p.add_argument(
        "--window",
        type=_window,
        default=None,
        help="START:END, seconds after the trace's first request, END excluded",
    )
    p.add_argument("--limit", type=_positive_int, default=None, help="keep the first N requests")
    p.add_argument("--model", default=None, help="model name to put in every request")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and Poisson arrivals")
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (outputs may then end early)",
    )


def run_trace(argv: list[str], environ: Mapping[str, str]) -> int:
    args = _parser().parse_args(argv)
    endpoint: Literal["completions", "chat_completions"] = (
        "chat_completions" if args.endpoint == "chat" else "completions"
    )
    if endpoint == "chat_completions" and args.prompt_format != "text":
        print("engine trace: --endpoint chat needs --prompt-format text", file=sys.stderr)
        return 2
    # Only Mooncake prompts are built from shared blocks; the others are unique throughout.
    block = args.block_tokens if args.kind == "mooncake" else MOONCAKE_BLOCK_TOKENS
    synth = PromptSynth(block, args.prompt_format, args.token_range, args.seed)
    input_scale = 1.0
    if args.kind == "mooncake":
        input_scale = block / MOONCAKE_BLOCK_TOKENS
    elif args.kind == "azure":
        input_scale = args.input_scale
    options = ImportOptions(
        synth=synth,
        endpoint=endpoint,
        model=args.model,
        ignore_eos=not args.no_ignore_eos,
        input_scale=input_scale,
        output_scale=args.output_scale,
        max_input=args.max_input,
        max_output=args.max_output,
        window=args.window,
        limit=args.limit,
    )
    try:
        result = _import(args, options)
    except (TraceImportError, ValueError) as e:
        print(f"engine trace: {e}", file=sys.stderr)
        return 2
    for problem in result.problems[:MAX_LISTED_PROBLEMS]:
        print(
            f"engine trace: {getattr(args, 'source', 'poisson')} {problem} (skipped)",
            file=sys.stderr,
        )
    if len(result.problems) > MAX_LISTED_PROBLEMS:
        print(
            f"engine trace: … and {len(result.problems) - MAX_LISTED_PROBLEMS} more malformed "
            "lines",
            file=sys.stderr,
        )
    try:
        with _output(args.output) as out:
            count = write_trace(result.records, out)
    except OSError as e:
        print(f"engine trace: cannot write {args.output}: {e.strerror or e}", file=sys.stderr)
        return 2
    where = "stdout" if args.output == "-" else args.output
    skipped = f", {len(result.problems)} malformed skipped" if result.problems else ""
    print(
        f"engine trace: wrote {count} requests to {where} ({result.rows_read} rows read{skipped})",
        file=sys.stderr,
    )
    return 0


def _import(args: argparse.Namespace, options: ImportOptions) -> ImportResult:
    if args.kind == "mooncake":
        return import_mooncake(args.source, options)
    if args.kind == "azure":
        return import_azure(args.source, options)
    return poisson_workload(
        rate=args.rate,
        num=args.num,
        input_len=args.input_len,
        output_len=args.output_len,
        options=options,
        seed=args.seed,
    )


@contextlib.contextmanager
def _output(path: str) -> Iterator[IO[bytes]]:
    if path == "-":
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    with open(path, "wb") as f:
        yield f


def _token_range(text: str) -> TokenRange:
    low, sep, high = text.partition(":")
    try:
        return TokenRange(int(low), int(high))
    except ValueError as e:
        detail = str(e) if sep and "token range" in str(e) else f"got {text!r}"
        raise argparse.ArgumentTypeError(
            f"expected LOW:HIGH token ids with 0 <= LOW < HIGH, e.g. 100:500; {detail}"
        ) from None


def _window(text: str) -> tuple[float, float]:
    start, sep, end = text.partition(":")
    try:
        window = (float(start), float(end))
    except ValueError:
        window = None
    if not sep or window is None or not 0 <= window[0] < window[1]:
        raise argparse.ArgumentTypeError(
            f"expected START:END in seconds with 0 <= START < END, e.g. 0:60, got {text!r}"
        )
    return window
