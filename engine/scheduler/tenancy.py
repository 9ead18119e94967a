"""The planner's view of tenants: what each may run in a step, who holds more than its share of
the KV cache, and the tokens and preemptions each was given (TenantTally: the tests and
benchmarks read it; per-tenant metrics are left to a later change).

A request's tenant is `Request.tenant` ("" on a server without tenants), its weight
`Request.weight`. Every rule here leaves a lone tenant exactly as the planner was without
tenants: its grant is the whole step and its share the whole cache.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from engine.scheduler.fair_share import FairShare
from engine.scheduler.requests import SequenceState


class StepRoom:
    """What is left of one step: tokens, bytes of the plan's frame, and each tenant's grant of
    tokens (None: tenants are not limited, a lone tenant or the step's second pass)."""

    def __init__(self, tokens: int, plan_bytes: int, grants: dict[str, int] | None) -> None:
        self.tokens = tokens
        self.plan_bytes = plan_bytes
        self.grants = grants

    def allowed(self, seq: SequenceState) -> int:
        """Tokens `seq` may run in this step."""
        if self.grants is None:
            return self.tokens
        return min(self.tokens, self.grants.get(seq.request.tenant, 0))

    def take(self, seq: SequenceState, num_tokens: int, size: int) -> None:
        self.tokens -= num_tokens
        self.plan_bytes -= size
        if self.grants is not None:
            self.grants[seq.request.tenant] -= num_tokens

    def lift_grants(self) -> bool:
        """Let anyone use what is left (a tenant could not use all of its grant); False if
        there were no grants."""
        limited = self.grants is not None
        self.grants = None
        return limited


def step_grants(
    share: FairShare,
    running: Sequence[SequenceState],
    waiting: Sequence[SequenceState],
    budget: int,
    free_slots: int,
) -> dict[str, int] | None:
    """Each tenant's tokens for the next step; None while at most one tenant has work (it may
    take the whole step). A tenant's demand is what its running sequences have left to compute
    and the prompts of its first waiting ones that could take the free sequence slots."""
    demands: Counter[str] = Counter()
    weights: dict[str, float] = {}
    for seq in running:
        demands[seq.request.tenant] += seq.num_uncomputed_tokens
        weights[seq.request.tenant] = seq.request.weight
    # Each tenant's first waiting sequences that could take the free slots: a tenant queued
    # behind another's many still has work (else the one ahead would take the whole step).
    queued: Counter[str] = Counter()
    for seq in waiting:
        tenant = seq.request.tenant
        if queued[tenant] < free_slots:
            queued[tenant] += 1
            demands[tenant] += seq.num_tokens
            weights[tenant] = seq.request.weight
    if len(demands) <= 1:
        share.grants({}, {}, budget)  # a lone tenant carries nothing into later steps
        return None
    capped = {tenant: min(demand, budget) for tenant, demand in demands.items()}
    return share.grants(capped, weights, budget)


def blocks_per_weight(running: Iterable[SequenceState]) -> dict[str, float]:
    """KV blocks each tenant's running sequences hold, per unit of its weight."""
    held: dict[str, float] = {}
    for seq in running:
        tenant = seq.request.tenant
        held[tenant] = held.get(tenant, 0.0) + len(seq.block_table.block_ids) / seq.request.weight
    return held


def over_share(
    tenant: str, running: Sequence[SequenceState], waiting: Sequence[SequenceState], blocks: int
) -> bool:
    """Whether `tenant` holds more of the `blocks` of the cache than its weight's share among the
    tenants with work (a lone tenant's share is the whole cache)."""
    weights = {seq.request.tenant: seq.request.weight for seq in (*running, *waiting)}
    if len(weights) <= 1 or tenant not in weights:
        return False
    held = sum(len(seq.block_table.block_ids) for seq in running if seq.request.tenant == tenant)
    return held > blocks * weights[tenant] / sum(weights.values())


class TenantTally:
    """Tokens planned for each tenant (prompt and output tokens apart) and its preemptions."""

    def __init__(self) -> None:
        self.prompt_tokens: Counter[str] = Counter()
        self.output_tokens: Counter[str] = Counter()
        self.preemptions: Counter[str] = Counter()

    def count(self, seq: SequenceState, start: int, num_tokens: int) -> None:
        """A chunk of `num_tokens` of `seq` from position `start` was planned."""
        in_prompt = max(0, min(start + num_tokens, seq.num_prompt_tokens) - start)
        self.prompt_tokens[seq.request.tenant] += in_prompt
        self.output_tokens[seq.request.tenant] += num_tokens - in_prompt
