"""Loading a Hugging Face tokenizer in a process that must not import torch.

The tokenizer and detokenizer actors only need transformers' tokenizers, but `transformers`
imports torch whenever torch is installed, which costs a spawned process seconds and hundreds of
MB (DESIGN §2). Marking torch as absent in `sys.modules` before the first transformers import
makes transformers take its torch-free path; only processes that never use torch call this.
"""

from __future__ import annotations

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
