"""A GGUF file's tokenizer (`tokenizer.ggml.*`, `tokenizer.chat_template`) as the
`tokenizer.json` and `tokenizer_config.json` the engine's tokenizer and detokenizer load.

transformers' GGUF conversion builds the vocabulary, merges and special tokens. Its choice of
pre-tokenizer holds for the names it knows; for byte-level vocabularies the split is set here from
llama.cpp's own table (src/llama-vocab.cpp), so text splits exactly as llama.cpp splits it on the
same file: SmolLM's `smollm`, for one, cuts every digit apart first, which transformers' default
GPT-2 split does not.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from engine.gguf.metadata import GGUFError
from engine.gguf.reader import GGUFFile

log = logging.getLogger(__name__)

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")

# `tokenizer.ggml.pre` -> (the regexes llama.cpp applies in turn, whether a word found whole in
# the vocabulary skips the merges: llama.cpp's `ignore_merges`).
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        ((r"\p{N}", _GPT2), False),
    ),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais"), ((_GPT2,), False)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), ((_LLAMA3,), True)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), ((_QWEN2,), False)),
    "default": (_DEFAULT, False),
}


def write_tokenizer(gguf: GGUFFile, out: Path) -> None:
    """tokenizer.json and tokenizer_config.json for the file's tokenizer, into directory `out`."""
    meta = gguf.metadata
    if "tokenizer.ggml.tokens" not in meta:
        raise GGUFError(
            f"{gguf.path}: no tokenizer in the file (tokenizer.ggml.tokens); name one with "
            "--tokenizer DIR"
        )
    backend = _backend_tokenizer(gguf)
    backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(gguf), indent=2))


def _backend_tokenizer(gguf: GGUFFile) -> Any:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from tokenizers import Regex, pre_tokenizers, processors
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    meta = gguf.metadata
    tokenizer_dict = {
        name: meta[f"tokenizer.{key}"]
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in meta
    }
    kind = tokenizer_dict.get("tokenizer_type")
    try:
        backend, _ = convert_gguf_tokenizer(str(meta.get("general.architecture")), tokenizer_dict)
    except (ValueError, KeyError) as e:
        raise GGUFError(f"{gguf.path}: cannot build its tokenizer ({kind!r}): {e}") from None
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if kind == "gpt2":
        if pre in PRE_TOKENIZERS:
            regexes, ignore_merges = PRE_TOKENIZERS[pre]
            splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
            byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
            backend.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
            backend.model.ignore_merges = ignore_merges
        else:
            log.warning(
                "%s: pre-tokenizer %r is not in the engine's table (%s); using transformers' "
                "split, which may differ from llama.cpp's",
                gguf.path,
                pre,
                ", ".join(sorted(PRE_TOKENIZERS)),
            )
    bos = _token(meta, "bos_token_id")
    if _adds_bos(meta) and bos is not None:
        bos_id = int(meta["tokenizer.ggml.bos_token_id"])
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1", special_tokens=[(bos, bos_id)]
        )
    else:
        backend.post_processor = None
    return backend


def _tokenizer_config(gguf: GGUFFile) -> dict[str, Any]:
    meta = gguf.metadata
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": _adds_bos(meta),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": int(meta.get(f"{meta.get('general.architecture')}.context_length", 0))
        or None,
    }
    for name in ("bos", "eos", "unknown", "padding"):
        token = _token(meta, f"{name}_token_id")
        if token is not None:
            key = {"unknown": "unk", "padding": "pad"}.get(name, name)
            config[f"{key}_token"] = token
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return config


def _adds_bos(meta: dict[str, Any]) -> bool:
    """llama.cpp adds BOS when the file says so; a sentencepiece vocabulary that says nothing
    gets one too."""
    flag = meta.get("tokenizer.ggml.add_bos_token")
    if flag is None:
        return meta.get("tokenizer.ggml.model") == "llama"
    return bool(flag)


def _token(meta: dict[str, Any], id_key: str) -> str | None:
    token_id = meta.get(f"tokenizer.ggml.{id_key}")
    tokens = meta["tokenizer.ggml.tokens"]
    if token_id is None or not 0 <= int(token_id) < len(tokens):
        return None
    return str(tokens[int(token_id)])
