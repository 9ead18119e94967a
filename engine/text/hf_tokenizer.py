"""Loading a Hugging Face tokenizer in a process that must not import torch.

The tokenizer and detokenizer actors only need transformers' tokenizers, but `transformers`
imports torch whenever torch is installed, which costs a spawned process seconds and hundreds of
MB; only the processes that run the model should pay that. Marking torch as absent in
`sys.modules` before the first transformers import makes transformers take its torch-free path;
only processes that never use torch call this.
The detokenizer needs less still: `load_token_decoder` skips transformers when it can. So does
a restarted tokenizer actor for text prompts: `TextEncoder` is the built tokenizer its predecessor
saved (`save_text_encoder`: the tokenizers library's own JSON of it, never pickle).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any

from engine.runtime.private_files import create_private, open_private

# Text whose tokens the saved state must reproduce before a successor may use it: words, spaces,
# digits, non-ASCII, and a special token written as text.
_SAMPLE = " Hello  world\n\t42 ünïcödé 日本語 🙂 <|im_start|>user <s> </s> the end."


def load_tokenizer_without_torch(model_path: str) -> Any:
    import_transformers_without_torch()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def import_transformers_without_torch() -> None:
    """Import transformers' tokenizer loading (seconds) with torch kept out of the process."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` -> ImportError
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found" banner
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers.models.auto.tokenization_auto  # noqa: F401


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


class TextEncoder:
    """A text prompt's tokens without transformers: `encode` as the transformers tokenizer
    that saved this state encodes (its backend, the `tokenizers` library, does the work)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)


def save_text_encoder(tokenizer: Any, path: str) -> bool:
    """Write `tokenizer`'s built backend to `path` (owner-only, renamed into place whole) for a
    successor's `load_text_encoder`; False, writing nothing, for a tokenizer whose encode is not
    its backend's alone (a slow tokenizer, or Python-side processing that changes the tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    for special in (True, False):
        theirs = tokenizer.encode(_SAMPLE, add_special_tokens=special)
        if TextEncoder(backend).encode(_SAMPLE, special) != list(theirs):
            return False
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        fd = create_private(temporary, os.O_WRONLY)
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(backend.to_str())
        os.rename(temporary, path)
    except OSError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        return False
    return True


def load_text_encoder(path: str) -> TextEncoder | None:
    """The encoder a predecessor saved at `path`; None when there is none. ForeignFileError
    for a file that is not a regular file of ours with mode 0600."""
    from tokenizers import Tokenizer

    try:
        fd = open_private(path)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, encoding="utf-8") as file:
        state = file.read()
    return TextEncoder(Tokenizer.from_str(state))


def remove_text_encoder(path: str) -> None:
    """Remove what `save_text_encoder` wrote at `path`, and what a writer killed halfway left."""
    directory, name = os.path.split(path)
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:  # the run directory is gone already
        return
    for entry in entries:
        if entry == name or (entry.startswith(name + ".") and entry.endswith(".tmp")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, entry))
