"""Model execution: architectures (Llama, Qwen2, Qwen3), loader, runner, checkpoint maker and
the built-in demo model.

Importing this package is cheap (no torch); the names below load their modules on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelRunner": "engine.model.runner",
    "ModelConfig": "engine.model.config",
    "load_model_config": "engine.model.config",
    "kv_cache_blocks": "engine.model.capacity",
    "CheckpointSpec": "engine.model.checkpoint_maker",
    "make_checkpoint": "engine.model.checkpoint_maker",
    "ensure_default_model": "engine.model.default_model",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine.model' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
