"""Fair share: each step's token budget divided among the tenants with work, by weight.

Shares are of tokens, prefill chunks and decodes alike, not of requests: a tenant that sends
ten times more requests gets no more of a step than its weight says, while another tenant has
work; a tenant alone gets the whole step. The split is weighted max-min fairness (water
filling): a tenant that needs less than its share gets what it needs, and what it leaves is
divided among the others by weight again.

Shares are fractions of a token; a step runs whole tokens. Each tenant's fraction is carried to
the next step (deficit round robin's deficit, bounded to one token either way), and the tokens
left after rounding down go to the largest remainders, so that over a window every tenant's
tokens are its exact share. A tenant with no work carries nothing: idle time banks no credit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def water_fill(
    demands: Mapping[str, int], weights: Mapping[str, float], budget: int
) -> dict[str, float]:
    """Weighted max-min fair shares of `budget` among `demands` (each > 0): no share exceeds
    its demand, and the tenants not fully served get equal shares per unit of weight."""
    shares: dict[str, float] = {}
    left = float(budget)
    weight_left = sum(weights[tenant] for tenant in demands)
    # The least demanding per unit of weight are served in full first.
    for tenant in sorted(demands, key=lambda t: demands[t] / weights[t]):
        level = left / weight_left if weight_left > 0 else 0.0
        share = min(float(demands[tenant]), weights[tenant] * level)
        shares[tenant] = share
        left -= share
        weight_left -= weights[tenant]
    return shares


class FairShare:
    """The grants of each step; what each tenant was owed or overpaid carries to the next."""

    def __init__(self) -> None:
        self._carry: dict[str, float] = {}

    def grants(
        self, demands: Mapping[str, int], weights: Mapping[str, float], budget: int
    ) -> dict[str, int]:
        """Tokens each tenant may run this step: `demands` (tokens it could run, at most
        `budget`; 0: no work) by `weights` (> 0). The grants sum to what the step can run."""
        active = {tenant: demand for tenant, demand in demands.items() if demand > 0}
        self._carry = {t: c for t, c in self._carry.items() if t in active}
        if len(active) <= 1:
            self._carry.clear()
            return {tenant: min(demand, budget) for tenant, demand in active.items()}
        targets = {
            tenant: share + self._carry.get(tenant, 0.0)
            for tenant, share in water_fill(active, weights, budget).items()
        }
        grants = {t: min(active[t], max(0, math.floor(target))) for t, target in targets.items()}
        spare = min(budget, sum(active.values())) - sum(grants.values())
        while spare > 0:  # a token each, largest remainders first, never past a demand
            behind = sorted(targets, key=lambda t: grants[t] - targets[t])
            open_ = [tenant for tenant in behind if grants[tenant] < active[tenant]][:spare]
            for tenant in open_:
                grants[tenant] += 1
            spare -= len(open_)
        while spare < 0:  # carried credit rounded up past the step: the most ahead give back
            ahead = sorted(targets, key=lambda t: targets[t] - grants[t])
            giving = [tenant for tenant in ahead if grants[tenant] > 0][:-spare]
            for tenant in giving:
                grants[tenant] -= 1
            spare += len(giving)
        self._carry = {t: max(-1.0, min(1.0, targets[t] - grants[t])) for t in targets}
        return grants
