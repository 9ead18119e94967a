"""Fault injection for tests: sequences whose prompt holds a chosen token id misbehave.

When the environment variable ENGINE_FAULT_INJECTION is set (never by the engine itself; nothing
a client sends can set it), a sequence whose prompt holds a chosen token id misbehaves whenever
one of its chunks runs. The value is a comma-separated list of ACTION:TOKEN_ID with ACTION one
of `raise` (the step raises, as a bug in the model code would) and `exit` (the process ends at
once with status 70, as a native crash would), e.g. `raise:501,exit:502`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

from engine.model.step_inputs import SeqChunk, SequenceStart

FAULT_INJECTION_ENV = "ENGINE_FAULT_INJECTION"
FAULT_EXIT_STATUS = 70  # EX_SOFTWARE: what an injected native crash exits with


class InjectedFault(RuntimeError):
    """Raised by fault injection (`raise:TOKEN_ID`); never seen unless a test asked for it."""


class FaultInjection:
    """Which sequences misbehave (see the module doc); empty unless a test configured it."""

    ACTIONS = ("raise", "exit")

    def __init__(self, spec: str = "") -> None:
        self.rules: dict[int, str] = {}  # token id -> action
        for part in filter(None, (p.strip() for p in spec.split(","))):
            action, _, token = part.partition(":")
            if action not in self.ACTIONS or not token.strip().isdigit():
                raise ValueError(
                    f"{FAULT_INJECTION_ENV} entry {part!r} must be ACTION:TOKEN_ID with ACTION "
                    f"one of {self.ACTIONS}, e.g. 'raise:501'"
                )
            self.rules[int(token)] = action
        self._armed: dict[int, str] = {}  # seq_id -> action

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> FaultInjection:
        return cls(environ.get(FAULT_INJECTION_ENV, ""))

    def watch(self, new_seq: SequenceStart) -> None:
        if self.rules:
            hits = [self.rules[t] for t in set(new_seq.prompt_token_ids) if t in self.rules]
            if hits:
                self._armed[new_seq.seq_id] = "exit" if "exit" in hits else "raise"

    def forget(self, seq_ids: Iterable[int]) -> None:
        if self._armed:
            for seq_id in seq_ids:
                self._armed.pop(seq_id, None)

    def reset(self) -> None:
        self._armed.clear()

    def trip(self, chunks: Sequence[SeqChunk]) -> None:
        """Misbehave if any of these chunks belongs to an armed sequence."""
        for chunk in chunks:
            action = self._armed.get(chunk.seq_id)
            if action == "exit":
                os._exit(FAULT_EXIT_STATUS)
            if action == "raise":
                raise InjectedFault(f"injected fault for sequence {chunk.seq_id}")
