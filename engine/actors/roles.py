"""The roles of the engine's actors (declared with the rings, engine/messages/roles.py), and what
a role means for the requests in flight."""

from __future__ import annotations

from engine.messages.roles import Role

__all__ = ["Role", "holds_requests"]


def holds_requests(role: str) -> bool:
    """Whether requests are in flight at an actor of this role: its crash counts against them
    (quarantine) and its restart resubmits them. A kv_transfer actor only moves KV blocks; its
    scheduler settles what it was moving (computes the prompt, or lets the hold time out)."""
    return role != Role.KV_TRANSFER
