"""Quotas: tokens per minute and requests in flight, per tenant, checked before admission.

A request takes a lease when it is admitted: it counts as in flight, and reserves what it may
cost (its prompt's tokens when their ids are known, and `max_tokens` for each sample). When it
ends, whatever the way (finished, stopped, aborted, failed), the reservation is replaced by what
it cost: its prompt and the tokens it generated, charged at that moment. Tokens never generated
are given back. A tenant is refused (429, with `Retry-After`) while its requests in flight reach
`max_concurrent_requests`, or while what it was charged in the last minute plus what its
requests in flight reserve reaches `tokens_per_minute`; a request that fits is admitted whole,
even if it may take the tenant past the limit (its next one waits).
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.request.outputs import EngineError
from engine.tenants.table import Tenant

WINDOW_S = 60.0


@dataclass
class _Account:
    """One tenant's minute: charges (time, tokens) oldest first, and what is in flight."""

    charges: deque[tuple[float, int]] = field(default_factory=deque)
    charged: int = 0
    reserved: int = 0
    in_flight: int = 0

    def expire(self, now: float) -> None:
        while self.charges and self.charges[0][0] <= now - WINDOW_S:
            self.charged -= self.charges.popleft()[1]

    def seconds_until_below(self, limit: int, now: float) -> int:
        """Whole seconds until enough charges leave the window to bring the tenant below
        `limit`; 1 when only the end of requests in flight can (their reservations)."""
        excess = self.charged + self.reserved - limit + 1
        for when, tokens in self.charges:
            excess -= tokens
            if excess <= 0:
                return max(1, math.ceil(when + WINDOW_S - now))
        return 1


class QuotaLease:
    """A request's place in its tenant's quotas until `settle` (once)."""

    def __init__(self, book: QuotaBook, tenant: str, reserved: int) -> None:
        self._book, self.tenant, self.reserved = book, tenant, reserved
        self._settled = False

    def settle(self, used_tokens: int) -> None:
        """The request ended having cost `used_tokens` (prompt + generated)."""
        if not self._settled:
            self._settled = True
            self._book.settle(self, used_tokens)


class QuotaBook:
    """Every tenant's account; `tenant_of(name)` gives its current limits (they change when the
    tenants file is reloaded, and apply from the next admission)."""

    def __init__(
        self, tenant_of: Callable[[str], Tenant | None], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._tenant_of = tenant_of
        self._clock = clock
        self._accounts: dict[str, _Account] = {}
        self.throttled: Counter[tuple[str, str]] = Counter()  # (tenant, quota) -> refusals
        self.admitted: Counter[str] = Counter()  # tenant -> requests admitted
        self.charged_tokens: Counter[str] = Counter()  # tenant -> tokens charged, ever

    def admit(self, tenant: str, reserve: int) -> QuotaLease:
        """A lease for a request of `tenant` that may cost `reserve` tokens; EngineError 429
        with its Retry-After when a quota is reached."""
        limits = self._tenant_of(tenant)
        account = self._accounts.setdefault(tenant, _Account())
        now = self._clock()
        account.expire(now)
        if limits is not None:
            self._check(tenant, limits, account, now)
            if limits.tokens_per_minute:
                reserve = min(reserve, limits.tokens_per_minute)
        account.in_flight += 1
        account.reserved += reserve
        self.admitted[tenant] += 1
        return QuotaLease(self, tenant, reserve)

    def _check(self, name: str, limits: Tenant, account: _Account, now: float) -> None:
        most = limits.max_concurrent_requests
        if most and account.in_flight >= most:
            self.throttled[name, "concurrent_requests"] += 1
            raise EngineError(
                f"tenant {name!r} has {account.in_flight} requests in flight, its limit "
                f"(max_concurrent_requests {most}); retry when one ends",
                429,
                retry_after=1,
            )
        limit = limits.tokens_per_minute
        if limit and account.charged + account.reserved >= limit:
            self.throttled[name, "tokens_per_minute"] += 1
            wait = account.seconds_until_below(limit, now)
            raise EngineError(
                f"tenant {name!r} used {account.charged} tokens in the last minute and "
                f"reserves {account.reserved} for requests in flight, its limit "
                f"(tokens_per_minute {limit}); retry in {wait} s",
                429,
                retry_after=wait,
            )

    def settle(self, lease: QuotaLease, used_tokens: int) -> None:
        account = self._accounts[lease.tenant]
        account.in_flight -= 1
        account.reserved -= lease.reserved
        if used_tokens > 0:
            account.charges.append((self._clock(), used_tokens))
            account.charged += used_tokens
            self.charged_tokens[lease.tenant] += used_tokens
        if not account.in_flight and not account.charges:
            del self._accounts[lease.tenant]  # nothing to remember: the book stays small

    def refusals(self, tenant: str) -> int:
        """Requests of `tenant` refused by any of its quotas so far."""
        return sum(count for (name, _), count in self.throttled.items() if name == tenant)

    def usage(self, tenant: str) -> tuple[int, int, int]:
        """(tokens charged in the last minute, tokens reserved, requests in flight)."""
        account = self._accounts.get(tenant)
        if account is None:
            return 0, 0, 0
        account.expire(self._clock())
        return account.charged, account.reserved, account.in_flight
