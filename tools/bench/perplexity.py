"""Perplexity of a fixed text on a GGUF file, by the engine (its block types served quantized, and
dequantized to float32) and by llama.cpp's `llama-perplexity` on the same file and text.

    python tools/bench/perplexity.py                           # the default model's file
    python tools/bench/perplexity.py --requantize Q4_0 Q8_0    # also llama-quantize'd copies
    python tools/bench/perplexity.py --file a.gguf --file b.gguf --text some.txt
    python tools/bench/perplexity.py --llama-cpp-args '' \
        --llama-cpp-args '-fa off -ctk f32 -ctv f32'

What each scorer scores. The text (default tests/data/perplexity_text.txt) is N tokens, no BOS
(the file's tokenizer.ggml.add_bos_token decides, as in llama.cpp), and is one window: every
token is predicted from the whole text before it, from position 0, on both sides.
- engine: one prefill of the N tokens with logits for every row (ModelRunner.prepare(...,
  every_row=)); each of the N - 1 tokens after the first is scored ("all" rows).
- llama.cpp: `llama-perplexity -c N -b N --chunks 1` scores one window of N tokens, but only
  its second half: tokens N/2 + 1 .. N - 1 (N - 1 - N/2 of them; `first = n_ctx/2` in
  perplexity.cpp). It needs at least 2 N tokens of input, so it reads the text repeated three
  times, whose first N tokens are checked (by llama-tokenize) to be the text's own. Scoring the
  whole window is not possible there: --ppl-stride S (perplexity_v2) scores the last S tokens of
  each window, but its window is the context llama.cpp allocates, -c + S/2 rounded up to a
  multiple of 256, so it equals N only when N is such a multiple.
- So the engine is also scored on llama.cpp's tokens ("half" rows): the same tokens, the same
  positions, the same context; those rows are the like-for-like comparison.
Ratios are to the engine's float32 (quantization none) perplexity of the same file on the same
tokens; with several files, "÷ first" is to the first file's. llama.cpp runs with its defaults
(-fa auto, an f16 KV cache) unless --llama-cpp-args gives it other options (-fa off and an
f32 cache moved this perplexity by half a percent on the default file: 17.93 to 18.03).

--requantize TYPE makes <stem>.TYPE.gguf from the first file with `llama-quantize
--allow-requantize` (kept in $ENGINE_HOME/peers/llama.cpp-VERSION/quantized) and scores it too.
tools/peers/llamacpp_peer.py builds llama-perplexity (and llama-quantize) once.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `engine` and `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.model.placement.policy import sleeping_openmp_threads

sleeping_openmp_threads()  # as the engine's workers do; before torch loads OpenMP

import torch  # noqa: E402

from tools.peers import llamacpp_peer  # noqa: E402

DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "tests" / "data" / "perplexity_text.txt"
REPEATS = 3  # llama-perplexity wants at least 2 windows of input; it scores the first only


@dataclasses.dataclass
class Score:
    file: str
    scorer: str
    tokens: str  # which tokens: "all" or "half"
    count: int
    first: int  # the first scored token's position; the last is N - 1
    nll: float  # mean negative log-likelihood, nats

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


def engine_tokens(gguf: Path, text: str, engine_home: Path) -> tuple[str, list[int]]:
    """The file's derived checkpoint directory, and the engine's tokens of `text` by it."""
    from engine.launch.model_source import model_directory
    from engine.text.hf_tokenizer import load_tokenizer_without_torch

    directory, _ = model_directory(str(gguf), engine_home)
    return directory, load_tokenizer_without_torch(directory).encode(text)


def engine_token_nll(directory: str, tokens: list[int], quantization: str) -> list[float]:
    """-log p(token i | tokens 0..i-1) for i = 1 .. N-1, by the engine, in one prefill."""
    from engine.model.runner import ModelRunner
    from engine.model.step_inputs import SeqChunk

    runner = ModelRunner(directory, kv_cache_memory=64 << 20, quantization=quantization)
    blocks = -(-len(tokens) // runner.block_size)
    if blocks > runner.num_blocks:
        raise SystemExit(f"{len(tokens)} tokens need {blocks} KV blocks, the cache has fewer")
    step = runner.prepare([SeqChunk(0, tokens, 0, list(range(blocks)), True)], every_row={0})
    with torch.inference_mode():
        logits = runner.execute(step)[:-1].double()
        nll = -logits.log_softmax(-1).gather(1, torch.tensor(tokens[1:]).unsqueeze(1))
    return nll.squeeze(1).tolist()


def padded_text(text: str) -> str:
    return text * REPEATS


def check_llama_cpp_tokens(gguf: Path, text: str, tokens: list[int]) -> None:
    """The first N tokens llama.cpp makes of the padded input are the engine's N tokens of the
    text (llama-perplexity's -f drops one trailing newline of the file, at the padding's end)."""
    from tools.data.llama_cpp_tokens import llama_cpp_ids

    padded = padded_text(text).removesuffix("\n")
    ids = llama_cpp_ids(llamacpp_peer.binary("llama-tokenize"), gguf, padded)
    if ids[: len(tokens)] != tokens:
        at = next(i for i, (a, b) in enumerate(zip(ids, tokens, strict=False)) if a != b)
        raise SystemExit(
            f"{gguf.name}: llama.cpp's tokens of the padded text differ from the engine's at "
            f"{at} of {len(tokens)}: {ids[at : at + 4]} against {tokens[at : at + 4]}"
        )
    if len(ids) < 2 * len(tokens):
        raise SystemExit(f"the padded text is {len(ids)} tokens, under 2 x {len(tokens)}")


def llama_cpp_perplexity(
    gguf: Path, text: str, window: int, extra: Sequence[str] = ()
) -> tuple[float, str]:
    """llama-perplexity's final estimate over one window of `window` tokens (`extra`: more of its
    options, e.g. -fa off), and its command."""
    with tempfile.TemporaryDirectory(prefix="perplexity-") as tmp:
        path = Path(tmp) / "text.txt"
        path.write_text(padded_text(text))
        cmd = [
            str(llamacpp_peer.binary("llama-perplexity")),
            "-m",
            str(gguf),
            "-f",
            str(path),
            "-c",
            str(window),
            "-b",
            str(window),
            "--chunks",
            "1",
            "-t",
            str(llamacpp_peer.THREADS),
            *extra,
        ]
        done = subprocess.run(
            cmd, capture_output=True, text=True, env=llamacpp_peer.peer_environment(), timeout=1800
        )
    output = done.stdout + done.stderr
    estimate = re.search(r"Final estimate: PPL = ([0-9.]+)", output)
    expected = f"calculating perplexity over 1 chunks, n_ctx={window}, batch_size={window}"
    if done.returncode != 0 or estimate is None or expected not in output:
        raise SystemExit(f"llama-perplexity failed (exit {done.returncode}):\n{output[-3000:]}")
    shown = [f"<the text x {REPEATS}>" if c == str(path) else shlex.quote(c) for c in cmd]
    return float(estimate.group(1)), " ".join(shown)


def requantized(source: Path, kind: str) -> Path:
    """<stem>.KIND.gguf made from `source` by llama-quantize --allow-requantize, made once."""
    out_dir = llamacpp_peer.peer_directory() / "quantized"
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = source.name.removesuffix(".gguf").rsplit(".", 1)[0]
    target = out_dir / f"{stem}.{kind}.gguf"
    if not target.is_file():
        partial = target.with_suffix(".partial")
        cmd = [
            str(llamacpp_peer.binary("llama-quantize")),
            "--allow-requantize",
            str(source),
            str(partial),
            kind,
            str(llamacpp_peer.THREADS),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"llama-quantize failed:\n{(done.stdout + done.stderr)[-3000:]}")
        partial.rename(target)
    return target


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def score_file(
    gguf: Path,
    text: str,
    quantizations: Sequence[str],
    llama_cpp: Sequence[str],
    engine_home: Path,
) -> tuple[list[Score], int, list[str]]:
    """The scores of one file, its text's token count N, and llama-perplexity's commands (one
    run for each of `llama_cpp`, a string of extra options, "" for none)."""
    directory, tokens = engine_tokens(gguf, text, engine_home)
    n = len(tokens)
    half = n // 2  # llama-perplexity's `first`: it scores tokens first + 1 .. n - 1
    scores: list[Score] = []
    commands = []
    if llama_cpp:  # first, while this process has no threads of its own
        check_llama_cpp_tokens(gguf, text, tokens)
    for options in llama_cpp:
        ppl, command = llama_cpp_perplexity(gguf, text, n, shlex.split(options))
        commands.append(command)
        scorer = f"llama.cpp {options}".strip()
        scores.append(Score(gguf.name, scorer, "half", n - 1 - half, half + 1, math.log(ppl)))
    for quantization in quantizations:
        nll = engine_token_nll(directory, tokens, quantization)
        name = f"engine {quantization}"
        scores.append(Score(gguf.name, name, "all", n - 1, 1, mean(nll)))
        # nll[i] is token i + 1's
        scores.append(Score(gguf.name, name, "half", n - 1 - half, half + 1, mean(nll[half:])))
    return scores, n, commands


def print_table(scores: list[Score], n: int) -> None:
    """The "all" rows, then the "half" rows (llama.cpp's tokens), each file in turn."""
    files = list(dict.fromkeys(s.file for s in scores))
    floats = {(s.file, s.tokens): s.perplexity for s in scores if s.scorer == "engine none"}
    several = len(files) > 1
    width = max(13, *(len(s.scorer) for s in scores))
    print(
        f"{'file':<36} {'scorer':<{width}} {'tokens scored':>16} {'perplexity':>10} "
        f"{'÷ float32':>9}" + (f" {'÷ first':>8}" if several else "")
    )
    for s in sorted(scores, key=lambda s: (s.tokens, files.index(s.file))):
        ref, first = floats.get((s.file, s.tokens)), floats.get((files[0], s.tokens))
        span = f"{s.count} ({s.first}..{n - 1})"
        line = f"{s.file:<36} {s.scorer:<{width}} {span:>16} {s.perplexity:>10.4f} "
        line += f"{s.perplexity / ref:>9.4f}" if ref else f"{'-':>9}"
        if several:
            line += f" {s.perplexity / first:>8.4f}" if first else f" {'-':>8}"
        print(line)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="a UTF-8 text file")
    parser.add_argument(
        "--file",
        type=Path,
        action="append",
        help="a .gguf file (repeatable; default: the default model's)",
    )
    parser.add_argument(
        "--requantize",
        nargs="*",
        default=[],
        metavar="TYPE",
        help="also score llama-quantize --allow-requantize copies of the first file "
        "(Q4_0, Q8_0...)",
    )
    parser.add_argument(
        "--quantization",
        nargs="+",
        default=["auto", "none"],
        choices=["auto", "none"],
        help="the engine's: auto (the file's block types served quantized), none (float32)",
    )
    parser.add_argument(
        "--llama-cpp-args",
        action="append",
        metavar="OPTIONS",
        help="a llama-perplexity run with these extra options, e.g. '-fa off -ctk f32 -ctv f32' "
        "(repeatable; '' is its defaults, the default run)",
    )
    parser.add_argument("--no-llama-cpp", action="store_true", help="the engine's scores only")
    parser.add_argument("--engine-home", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    from engine.launch.model_source import default_model_file
    from engine.settings.home import default_engine_home

    args = parse_args(argv)
    engine_home = args.engine_home or default_engine_home()
    files = [llamacpp_peer.model_file(str(f)) for f in args.file or []] or [default_model_file()]
    files += [requantized(files[0], kind) for kind in args.requantize]
    text = args.text.read_text()
    scores: list[Score] = []
    lengths = set()
    for gguf in files:
        llama_cpp = [] if args.no_llama_cpp else args.llama_cpp_args or [""]
        file_scores, n, commands = score_file(gguf, text, args.quantization, llama_cpp, engine_home)
        scores += file_scores
        lengths.add(n)
        for command in commands:
            print(command)
    if len(lengths) != 1:
        raise SystemExit(f"the files' tokenizers split the text differently: {sorted(lengths)}")
    n = lengths.pop()
    print(f"text {args.text.name}: N = {n} tokens, one window; 'all' scores tokens 1..{n - 1},")
    print(f"'half' tokens {n // 2 + 1}..{n - 1} (llama-perplexity's second half of the window)")
    print_table(scores, n)


if __name__ == "__main__":
    main()
