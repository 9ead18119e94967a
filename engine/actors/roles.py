"""The roles of the engine's actors, as their ChildSpecs declare them (`ChildSpec.role`)."""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    TOKENIZER = "tokenizer"
    SCHEDULER = "scheduler"
    WORKER = "worker"
    DETOKENIZER = "detokenizer"
    KV_TRANSFER = "kv_transfer"


def holds_requests(role: str) -> bool:
    """Whether requests are in flight at an actor of this role: its crash counts against them
    (quarantine) and its restart resubmits them. A kv_transfer actor only moves KV blocks; its
    scheduler settles what it was moving (computes the prompt, or lets the hold time out)."""
    return role != Role.KV_TRANSFER
