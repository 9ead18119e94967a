"""Loading a Hugging Face tokenizer in a process that must not import torch.

The tokenizer and detokenizer actors only need transformers' tokenizers, but `transformers`
imports torch whenever torch is installed, which costs a spawned process seconds and hundreds of
MB; only the processes that run the model should pay that. Marking torch as absent in
`sys.modules` before the first transformers import makes transformers take its torch-free path;
only processes that never use torch call this.
The detokenizer needs less still: `load_token_decoder` skips transformers when it can.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def load_tokenizer_without_torch(model_path: str) -> Any:
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` -> ImportError
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found" banner
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def load_token_decoder(model_path: str) -> Any:
    """What the detokenizer needs of a tokenizer: `decode(ids, skip_special_tokens)`.

    A transformers fast tokenizer decodes through a `tokenizers.Tokenizer` built from the
    checkpoint's tokenizer.json (its backend_tokenizer). Reading that file with the `tokenizers`
    library alone is quick, where importing transformers is a large import that every
    detokenizer start and restart would pay. A checkpoint without tokenizer.json, or whose
    tokenizer_config.json declares added tokens that tokenizer.json lacks (transformers would
    add them), loads through transformers instead.
    """
    from tokenizers import Tokenizer

    tokenizer_json = os.path.join(model_path, "tokenizer.json")
    if not os.path.isfile(tokenizer_json):
        return load_tokenizer_without_torch(model_path)
    decoder = Tokenizer.from_file(tokenizer_json)
    known = {token.content for token in decoder.get_added_tokens_decoder().values()}
    if not _declared_added_tokens(model_path) <= known:
        return load_tokenizer_without_torch(model_path)
    return decoder


def _declared_added_tokens(model_path: str) -> set[str]:
    try:
        with open(os.path.join(model_path, "tokenizer_config.json")) as file:
            config = json.load(file)
    except FileNotFoundError:
        return set()
    declared = config.get("added_tokens_decoder") or {}
    return {entry["content"] for entry in declared.values() if isinstance(entry, dict)}
