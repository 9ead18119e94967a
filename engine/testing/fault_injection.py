"""Fault injection for tests: sequences whose prompt holds a chosen token id misbehave.

When the environment variable ENGINE_FAULT_INJECTION is set (never by the engine itself; nothing
a client sends can set it), a sequence whose prompt holds a chosen token id misbehaves whenever
one of its chunks runs. The value is a comma-separated list of ACTION[@RANK]:TOKEN_ID, e.g.
`raise:501,exit:502,raise-late@0:503,sleep3@1:504`, with ACTION one of:
- `raise`: the step raises before the model runs, as a bug in input preparation would;
- `raise-late`: the step raises after the model ran, where rank 0 samples, as a failure in
  sampling would (a tensor-parallel rank 0's logits and sampler make that likelier there); only
  rank 0 has this part;
- `exit`: the process ends at once with status 70, as a native crash would;
- `sleepS`: the step sleeps S seconds (a float) before the model runs, as a slow step (or a rank
  that stops taking part in its group's collectives) would.
`@RANK` limits the rule to one tensor-parallel rank; without it every rank misbehaves.

The engine's processes load it through their hooks (engine/runtime/hooks.py): `environment()`
is what a test sets for its engines, e.g. `os.environ.update(environment(FAULT_INJECTION_ENV,
"raise:501"))`; the workers and kv_transfer actors it spawns inherit it.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from engine.model.step_inputs import SeqChunk, SequenceStart
from engine.runtime.hooks import HOOKS_ENV

FAULT_INJECTION_ENV = "ENGINE_FAULT_INJECTION"
# Seconds each kv_transfer actor's pull waits before it starts (P/D tests: a kill then lands
# while KV is on its way). Like FAULT_INJECTION_ENV, only tests set it.
KV_PULL_DELAY_ENV = "ENGINE_KV_PULL_DELAY"
FAULT_EXIT_STATUS = 70  # EX_SOFTWARE: what an injected native crash exits with

log = logging.getLogger(__name__)

_RULE = re.compile(r"(raise-late|raise|exit|sleep(\d+(?:\.\d+)?))(?:@(\d+))?:(\d+)")


class InjectedFault(RuntimeError):
    """Raised by fault injection (`raise:TOKEN_ID`); never seen unless a test asked for it."""


class FaultInjection:
    """Which sequences misbehave, on this rank (see the module doc); empty unless a test
    configured it."""

    def __init__(self, spec: str = "", rank: int = 0) -> None:
        self.rules: dict[int, str] = {}  # token id -> action
        for part in filter(None, (p.strip() for p in spec.split(","))):
            match = _RULE.fullmatch(part)
            if match is None:
                raise ValueError(
                    f"{FAULT_INJECTION_ENV} entry {part!r} must be ACTION[@RANK]:TOKEN_ID with "
                    "ACTION one of raise, raise-late, exit, sleepSECONDS, e.g. 'raise:501'"
                )
            action, _seconds, only_rank, token = match.groups()
            if only_rank is None or int(only_rank) == rank:
                self.rules[int(token)] = action
        self._armed: dict[int, list[str]] = {}  # seq_id -> actions

    @classmethod
    def from_environment(cls, environ: Mapping[str, str], rank: int = 0) -> FaultInjection:
        return cls(environ.get(FAULT_INJECTION_ENV, ""), rank)

    def watch(self, new_seq: SequenceStart) -> None:
        if self.rules:
            hits = [self.rules[t] for t in set(new_seq.prompt_token_ids) if t in self.rules]
            if hits:
                self._armed[new_seq.seq_id] = hits

    def forget(self, seq_ids: Iterable[int]) -> None:
        if self._armed:
            for seq_id in seq_ids:
                self._armed.pop(seq_id, None)

    def reset(self) -> None:
        self._armed.clear()

    def trip(self, chunks: Sequence[SeqChunk]) -> None:
        """Before the model runs: misbehave if any of these chunks belongs to an armed
        sequence."""
        for actions in self._actions(chunks):
            for action in actions:
                if action == "exit":
                    os._exit(FAULT_EXIT_STATUS)
                if action.startswith("sleep"):
                    time.sleep(float(action.removeprefix("sleep")))
                if action == "raise":
                    raise InjectedFault(f"injected fault ({action})")

    def trip_late(self, chunks: Sequence[SeqChunk]) -> None:
        """After the model ran, before rank 0 samples (called on rank 0 only)."""
        for actions in self._actions(chunks):
            if "raise-late" in actions:
                raise InjectedFault("injected fault (raise-late)")

    def _actions(self, chunks: Sequence[SeqChunk]) -> Iterable[list[str]]:
        if self._armed:
            for chunk in chunks:
                actions = self._armed.get(chunk.seq_id)
                if actions:
                    yield actions


def environment(variable: str, value: str) -> dict[str, str]:
    """The environment that turns on one of this module's faults (`variable`: FAULT_INJECTION_ENV
    or KV_PULL_DELAY_ENV) in the engine processes it is given to."""
    return {HOOKS_ENV: __name__, variable: value}


def install_worker(worker: Any) -> None:
    """The worker actor's hook: its step faults, for its rank."""
    faults = FaultInjection.from_environment(os.environ, worker.rank)
    if faults.rules:
        log.warning("fault injection is on: %s", faults.rules)
        worker.step_faults = faults


def install_kv_transfer(actor: Any) -> None:
    """The kv_transfer actor's hook: each pull waits KV_PULL_DELAY_ENV seconds first."""
    delay = float(os.environ.get(KV_PULL_DELAY_ENV) or 0.0)
    if delay:
        log.warning("%s is set: each pull waits %g s first", KV_PULL_DELAY_ENV, delay)
        actor.pull_delay = delay
