"""Make random-weight GGUF files at the shapes of real 1-8B models, as CPU users download them:
a Hugging Face checkpoint built by transformers' own config and model classes at a named shape,
with the default model's tokenizer (`engine export default`), converted by the llama.cpp
`convert_hf_to_gguf.py` vendored in llama-cpp-python's source distribution and quantized by its
`llama-quantize` (tools/peers/llamacpp_peer.py builds it).

    python tools/data/make_gguf.py smollm2-1.7b                     # Q4_K_M, Q5_K_M, Q6_K, ...
    python tools/data/make_gguf.py llama-3.2-1b --types Q4_K_M Q8_0 --out /tmp/l32
    python tools/data/make_gguf.py smollm2-1.7b --layers 2 --types Q4_0 Q5_1  # a small file
    python tools/data/make_gguf.py --list

Speed depends only on the shape, so random weights serve the benchmarks (tools/bench/serving.py
and one_batch.py take the files with --model, beside llama.cpp on the same file). The weights are
drawn with a spread (--init-std) large enough that the logits are far from uniform, so that the
logits and the perplexity of two implementations tell them apart (tools/bench/perplexity.py).

The converter imports `sentencepiece`; it is installed with `pip install --target` into a
directory of its own and put on the converter's PYTHONPATH (with the vendored gguf-py), never
into the project's venv. Files land in $ENGINE_HOME/peers/made/models/<shape>/<TYPE>.gguf
unless --out says otherwise (the converter and sentencepiece beside models/, outside the
binaries' directory, which a build renames into place whole); each step is skipped when its
output is there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "peers"))
from llamacpp_peer import binary, download_sdist, peer_directory

CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}
# The converter's classes that read a sentencepiece model for their vocabulary: with the default
# model's BPE tokenizer they take the converter's own gpt2 path instead (as for llama files).
SENTENCEPIECE_VOCAB = ("Gemma2Model", "Gemma3Model", "Phi3MiniModel")
TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS")
SENTENCEPIECE = "sentencepiece==0.2.3"
# The converter and what it imports, from the source distribution's vendored llama.cpp.
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion", "gguf-py")


@dataclasses.dataclass(frozen=True)
class Shape:
    arch: str  # transformers' config and model classes: llama, qwen2
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tie: bool
    rope_theta: float
    context: int
    extra: tuple[tuple[str, Any], ...] = ()  # more of the config's arguments


# Real models' shapes (their config.json), the vocabulary the default model's tokenizer's.
SHAPES = {
    "smollm2-360m": Shape("llama", 960, 32, 15, 5, 2560, True, 100000.0, 8192),
    "smollm2-1.7b": Shape("llama", 2048, 24, 32, 32, 8192, True, 130000.0, 8192),
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, True, 500000.0, 131072),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 8960, True, 1000000.0, 32768),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, False, 500000.0, 131072),
    "mistral-7b-v0.1": Shape(
        "mistral", 4096, 32, 32, 8, 14336, False, 10000.0, 32768, (("sliding_window", 4096),)
    ),
    "gemma-2-2b": Shape(
        "gemma2",
        2304,
        26,
        8,
        4,
        9216,
        True,
        10000.0,
        8192,
        (
            ("head_dim", 256),
            ("query_pre_attn_scalar", 256),
            ("sliding_window", 4096),
            ("attn_logit_softcapping", 50.0),
            ("final_logit_softcapping", 30.0),
        ),
    ),
    "phi-3-mini": Shape(
        "phi3", 3072, 32, 32, 32, 8192, False, 10000.0, 4096, (("sliding_window", 2047),)
    ),
    "qwen3-30b-a3b": Shape(
        "qwen3_moe",
        2048,
        48,
        32,
        4,
        6144,
        False,
        1000000.0,
        40960,
        (
            ("head_dim", 128),
            ("num_experts", 128),
            ("num_experts_per_tok", 8),
            ("moe_intermediate_size", 768),
            ("norm_topk_prob", True),
        ),
    ),
}


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 3600) -> None:
    print(f"make_gguf: {' '.join(cmd[:4])} ...", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"`{' '.join(cmd)}` failed:\n{(done.stdout + done.stderr)[-3000:]}")


def tokenizer_files(work: Path) -> Path:
    """The default model's tokenizer (and chat template), from `engine export default`."""
    target = work / "default-export"
    if not (target / "tokenizer.json").is_file():
        staging = Path(tempfile.mkdtemp(prefix=".export-", dir=work)) / "out"
        run([sys.executable, "-m", "engine", "export", "default", str(staging)])
        os.rename(staging, target)
    return target


def make_checkpoint(name: str, shape: Shape, out: Path, tokenizer: Path, init_std: float) -> None:
    """A random checkpoint of `shape` in bfloat16, saved by transformers with the tokenizer."""
    import torch
    import transformers

    exported = json.loads((tokenizer / "config.json").read_text())
    config_class, model_class = (getattr(transformers, n) for n in CLASSES[shape.arch])
    config = config_class(
        vocab_size=exported["vocab_size"],
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        max_position_embeddings=shape.context,
        tie_word_embeddings=shape.tie,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        bos_token_id=exported.get("bos_token_id"),
        eos_token_id=exported.get("eos_token_id"),
        pad_token_id=exported.get("eos_token_id"),
        dtype="bfloat16",
        **dict(shape.extra),
    )
    torch.set_default_dtype(torch.bfloat16)
    model = model_class(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param_name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            scale = 0.2 if param_name.endswith("norm.weight") else init_std
            param.copy_((1.0 if param_name.endswith("norm.weight") else 0.0) + scale * noise)
    model.save_pretrained(out)
    for file in tokenizer.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation")):
            shutil.copy2(file, out / file.name)
    (out / "make_gguf.json").write_text(json.dumps({"shape": name, "init_std": init_std}))


def converter(peer: Path, sdist: Path | None = None) -> Path:
    """The vendored converter's directory (extracted once from the source distribution: `sdist`,
    else downloaded)."""
    target = peer / "converter"
    if not (target / CONVERTER_PARTS[0]).is_file():
        staging = Path(tempfile.mkdtemp(prefix=".converter-", dir=peer))
        archive = sdist or download_sdist(staging)
        with tarfile.open(archive) as tar:
            script = next(
                n for n in tar.getnames() if n.endswith(f"/vendor/llama.cpp/{CONVERTER_PARTS[0]}")
            )
            prefix = script.removesuffix(f"/{CONVERTER_PARTS[0]}")
            members = [
                m
                for m in tar.getmembers()
                if any(m.name.startswith(f"{prefix}/{part}") for part in CONVERTER_PARTS)
            ]
            tar.extractall(staging, members=members, filter="data")
        os.rename(staging / prefix, target)
        shutil.rmtree(staging, ignore_errors=True)
    return target


def sentencepiece_target(peer: Path) -> Path:
    """sentencepiece installed into a directory of its own (never the project's venv)."""
    target = peer / "sentencepiece"
    if not (target / "sentencepiece").is_dir():
        staging = Path(tempfile.mkdtemp(prefix=".sentencepiece-", dir=peer))
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(staging)]
        run([*pip, SENTENCEPIECE])
        os.rename(staging, target)
    return target


def convert(checkpoint: Path, f16: Path, peer: Path, sdist: Path | None) -> None:
    source = converter(peer, sdist)
    paths = [str(sentencepiece_target(peer)), str(source / "gguf-py"), str(source)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    partial = f16.with_suffix(".partial")
    patch = (
        "import runpy, sys; from conversion import base, gemma, phi\n"
        f"for name in {SENTENCEPIECE_VOCAB!r}:\n"
        "    cls = getattr(gemma, name, None) or getattr(phi, name)\n"
        "    cls.set_vocab = base.TextModel._set_vocab_gpt2\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    script = [sys.executable, "-c", patch, str(source / "convert_hf_to_gguf.py"), str(checkpoint)]
    run([*script, "--outtype", "f16", "--outfile", str(partial)], env=env)
    partial.rename(f16)


def quantize(f16: Path, out: Path, type_name: str) -> None:
    partial = out.with_suffix(".partial")
    run([str(binary("llama-quantize")), str(f16), str(partial), type_name, "2"])
    partial.rename(out)


def made_directory() -> Path:
    """Where the converter, sentencepiece and the files go (beside the peer's binaries)."""
    return peer_directory().parent / "made"


def make_files(
    name: str, types: list[str], out: Path, init_std: float, sdist: Path | None = None
) -> list[Path]:
    peer = made_directory()
    work = peer / "models"
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = out / "hf"
    if not (checkpoint / "config.json").is_file():
        staging = Path(tempfile.mkdtemp(prefix=".hf-", dir=out))
        make_checkpoint(name, SHAPES[name], staging, tokenizer_files(work), init_std)
        os.rename(staging, checkpoint)
    f16 = out / "F16.gguf"
    if not f16.is_file():
        convert(checkpoint, f16, peer, sdist)
    made = []
    for type_name in types:
        target = out / f"{type_name}.gguf"
        if not target.is_file():
            quantize(f16, target, type_name)
        made.append(target)
    return made


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("shape", nargs="?", choices=sorted(SHAPES))
    parser.add_argument("--types", nargs="+", default=list(TYPES), help="llama-quantize's types")
    parser.add_argument("--out", type=Path, help="directory (default: peers/made/models/<shape>)")
    parser.add_argument("--init-std", type=float, default=0.05, help="the weights' spread")
    parser.add_argument("--layers", type=int, help="cut the shape to this many layers")
    parser.add_argument("--sdist", type=Path, help="llama_cpp_python-*.tar.gz (else downloaded)")
    parser.add_argument("--list", action="store_true", help="print the shapes and stop")
    args = parser.parse_args(argv)
    if args.list or args.shape is None:
        for name, shape in SHAPES.items():
            fields: dict[str, Any] = dataclasses.asdict(shape)
            print(f"{name}: {', '.join(f'{k} {v}' for k, v in fields.items())}")
        return
    name = args.shape if args.layers is None else f"{args.shape}-{args.layers}layers"
    if args.layers is not None:
        SHAPES[name] = dataclasses.replace(SHAPES[args.shape], layers=args.layers)
    out = args.out or made_directory() / "models" / name
    for path in make_files(name, args.types, out, args.init_std, args.sdist):
        print(f"{path} ({path.stat().st_size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
