"""Messages among the ranks of a tensor-parallel group.

- `Rendezvous` (ring worker rank 0 -> the other ranks of its host): where the group's TCP store
  listens. Rank 0 binds a free port each time the group (re)starts, so a restarted group never
  meets the old one's port; the ring carrying it is renewed with the group too.
- `RelayedPlan` (over the process group, rank 0 -> ranks on other hosts, which cannot read the
  plan ring): the plan rank 0 is about to run.
"""

from __future__ import annotations

import msgspec

from engine.messages.codec import Channel
from engine.messages.steps import StepPlan


class Rendezvous(msgspec.Struct, tag=True, array_like=True):
    master_addr: str
    master_port: int


RENDEZVOUS: Channel[Rendezvous] = Channel("tp-rendezvous", Rendezvous)


class RelayedPlan(msgspec.Struct, tag=True, array_like=True):
    """A StepPlan as rank 0 forwards it to ranks on other hosts (over the process group).

    `sequences_generation` changes when rank 0 met a restarted scheduler: the other ranks drop
    their sequences then too, exactly where rank 0 did.
    """

    sequences_generation: int
    plan: StepPlan


RELAYED_PLANS: Channel[RelayedPlan] = Channel("tp-relayed-plan", RelayedPlan)
