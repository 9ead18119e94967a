"""Holding a request in flight by a means the test controls, on a machine of any speed.

A test that acts on a running request (aborts it, kills an actor under it, fills the queue
behind it) must never assume that it is still running after some tokens or some time: on a fast
machine the tiny test checkpoints decode a 1,000-token request in a fraction of a second. The
worker's fault injection (engine/testing/fault_injection.py) makes each step that runs a
sequence whose prompt holds HOLD_TOKEN sleep HOLD_STEP_S before the model runs. So such a
request of N tokens stays in flight for at least N * HOLD_STEP_S seconds whatever the machine,
and, steps being batched, every request running beside it is paced the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from engine.testing.fault_injection import FAULT_INJECTION_ENV, environment
from tests.environment import environment_set

HOLD_TOKEN = 505  # " When" in the tiny test checkpoints' tokenizer, in no other test's text
HOLD_TEXT = " When"  # a text prompt holding it: the space belongs to the token
HOLD_STEP_S = 0.02
HOLD_RULE = f"sleep{HOLD_STEP_S:g}:{HOLD_TOKEN}"


def held(ids: list[int]) -> list[int]:
    """A token-id prompt that is held: `ids` after HOLD_TOKEN."""
    return [HOLD_TOKEN, *ids]


def hold_env(*other_rules: str) -> dict[str, str]:
    """The environment a server's workers need for HOLD_RULE (and `other_rules`)."""
    return environment(FAULT_INJECTION_ENV, ",".join((*other_rules, HOLD_RULE)))


@contextmanager
def holding(*other_rules: str) -> Iterator[None]:
    """Engines started in this process within the block hold HOLD_TOKEN's requests (their
    workers are spawned with this environment)."""
    with environment_set(hold_env(*other_rules)):
        yield
