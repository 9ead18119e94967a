"""The roles of the engine's actors, as their ChildSpecs declare them (`ChildSpec.role`)."""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    TOKENIZER = "tokenizer"
    SCHEDULER = "scheduler"
    WORKER = "worker"
    DETOKENIZER = "detokenizer"
    KV_TRANSFER = "kv_transfer"
