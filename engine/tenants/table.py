"""Tenants as the server knows them: who each API key belongs to, and what that tenant may do.

A key is never kept: only its SHA-256 digest, in the tenants file and in memory. A request's key
is hashed and looked up; keys are random tokens, so the digest's dictionary lookup tells a
guesser nothing about a real key (GitHub's and most API gateways' tokens are kept the same way).
"""

from __future__ import annotations

import fnmatch
import hashlib
from dataclasses import dataclass, field

from engine.messages.scheduling import TenantTag

DEFAULT_NAME = "default"  # the one tenant of a server without a tenants file


def key_digest(key: str) -> str:
    """The SHA-256 digest of an API key, as hex: what the tenants file holds."""
    return hashlib.sha256(key.strip().encode()).hexdigest()


@dataclass(frozen=True)
class Tenant:
    """One tenant: its name, its weight in each step's fair share of tokens, the most urgent
    priority it may ask for (vLLM's `priority`: lower runs first), its quotas (0: none), the
    models it may use (shell patterns; None: every one) and the prefix-cache scope its requests
    share cached prefixes in."""

    name: str
    weight: float = 1.0
    priority_ceiling: int = 0
    tokens_per_minute: int = 0
    max_concurrent_requests: int = 0
    models: tuple[str, ...] | None = None
    cache_scope: str = ""
    tag: TenantTag | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tag", TenantTag(self.name, self.weight, self.cache_scope))

    @property
    def default_priority(self) -> int:
        """What a request that names no priority gets: 0, or the ceiling if 0 is above it."""
        return max(0, self.priority_ceiling)

    def may_use(self, model: str) -> bool:
        return self.models is None or any(fnmatch.fnmatchcase(model, p) for p in self.models)


# The one tenant of a server without a tenants file: requests carry no tag, so the scheduler,
# the prefix cache and the ids behave exactly as before tenants existed.
EVERYONE = Tenant(DEFAULT_NAME, priority_ceiling=-(2**63))  # any priority, as vLLM allows


@dataclass(frozen=True)
class TenantTable:
    """Every tenant by name (in the file's order) and by the digest of each of its keys."""

    by_name: dict[str, Tenant]
    by_digest: dict[str, Tenant]

    def find(self, key: str) -> Tenant | None:
        """The tenant whose key this is; None for an unknown key."""
        return self.by_digest.get(key_digest(key))

    def names(self) -> list[str]:
        return list(self.by_name)
