"""The parties of the rings: the roles of the engine's actors (as their ChildSpecs declare them,
`ChildSpec.role`) and the root process.

They live with the messages because the ring catalogue (ring_catalogue.py) names them: which
role writes a ring and which read it."""

from __future__ import annotations

import enum

ROOT = "root"  # the root process (the gateway): a party of rings, not an actor's role


class Role(enum.StrEnum):
    TOKENIZER = "tokenizer"
    SCHEDULER = "scheduler"
    WORKER = "worker"
    DETOKENIZER = "detokenizer"
    KV_TRANSFER = "kv_transfer"
