"""The built-in demo model: a small random Qwen3 checkpoint, built once and cached.

`ensure_default_model()` returns its directory under $ENGINE_HOME (default ~/.cache/engine),
building it on first use with the same checkpoint maker as tools/data/make_model.py. The build goes
to a temporary directory that is renamed into place, so concurrent starters never see half a
model. Checking the cache imports no torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path

from engine.demo.checkpoint_maker import CheckpointSpec
from engine.settings.home import build_directory, check_home_path, default_engine_home

log = logging.getLogger(__name__)

# Small enough for fast tests and synthetic benchmarks: 7.3 M parameters, 4 layers, hidden 256.
DEFAULT_MODEL_SPEC = CheckpointSpec(
    arch="qwen3",
    num_layers=4,
    hidden_size=256,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=768,
    vocab_size=8192,
    max_position_embeddings=8192,
    dtype="float32",
    seed=0,
)
# Bump when the maker's output changes for the same spec, so caches rebuild.
DEFAULT_MODEL_VERSION = 3  # 3: the chat template renders tools


def default_model_dir(engine_home: str | None = None) -> Path:
    home = Path(engine_home).expanduser() if engine_home else default_engine_home()
    return home / "models" / f"demo-qwen3-{_fingerprint()}"


def ensure_default_model(engine_home: str | None = None) -> str:
    """Path of the built-in demo model, building it first if this engine home lacks it."""
    target = default_model_dir(engine_home)
    if not (target / "config.json").is_file():
        _build(target)
    home = Path(engine_home).expanduser() if engine_home else default_engine_home()
    check_home_path(target, home)  # weights another user could have replaced: refused
    log.info(
        "using the built-in demo model (random weights, %s, %d layers, hidden %d, vocab %d) at %s",
        DEFAULT_MODEL_SPEC.arch,
        DEFAULT_MODEL_SPEC.num_layers,
        DEFAULT_MODEL_SPEC.hidden_size,
        DEFAULT_MODEL_SPEC.vocab_size,
        target,
    )
    return str(target)


def _build(target: Path) -> None:
    from engine.demo.checkpoint_maker import make_checkpoint

    log.info("building the built-in demo model (once) in %s", target)
    build_directory(
        target, lambda staging: make_checkpoint(staging, DEFAULT_MODEL_SPEC), "config.json"
    )


def _fingerprint() -> str:
    from engine.demo.tokenizer_maker import DEFAULT_CORPUS

    digest = hashlib.sha256()
    spec = json.dumps(dataclasses.asdict(DEFAULT_MODEL_SPEC), sort_keys=True)
    digest.update(f"{DEFAULT_MODEL_VERSION}\n{spec}\n".encode())
    digest.update(DEFAULT_CORPUS.read_bytes())
    return digest.hexdigest()[:12]
