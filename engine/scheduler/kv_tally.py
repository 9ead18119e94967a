"""The pieces the scheduler's P/D holds and pulls share (engine/scheduler/kv_handoff.py): how
per-rank reports become one outcome, where the ranks' kv_transfer actors serve, and the counts
the scheduler reports."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.messages.kv_transfer import TransferEndpoint


class Outcome(enum.Enum):
    DONE = "done"  # every rank reported success
    FAILED = "failed"  # some rank reported failure (the others may still be at work)


class RankTally:
    """Per-rank reports of one transfer, to one outcome: DONE only when every rank of the group
    reported success; FAILED from the first failure on. Reports of unknown ranks and repeats
    change nothing."""

    def __init__(self, num_ranks: int) -> None:
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        self.num_ranks = num_ranks
        self.succeeded: set[int] = set()
        self.failed: dict[int, str] = {}

    def record(self, rank: int, error: str | None = None) -> Outcome | None:
        if 0 <= rank < self.num_ranks and rank not in self.succeeded and rank not in self.failed:
            if error is None:
                self.succeeded.add(rank)
            else:
                self.failed[rank] = error
        return self.outcome

    @property
    def outcome(self) -> Outcome | None:
        if self.failed:
            return Outcome.FAILED
        if len(self.succeeded) == self.num_ranks:
            return Outcome.DONE
        return None

    @property
    def all_reported(self) -> bool:
        return len(self.succeeded) + len(self.failed) == self.num_ranks

    def first_error(self) -> str:
        return next(iter(self.failed.values()), "")


@dataclass
class KvTransferFigures:
    """Counts since start, for stats and /metrics."""

    handoffs: int = 0  # requests handed on (prefill side)
    holds_refused: int = 0  # handoffs whose blocks were not held: held blocks at their cap
    holds_expired: int = 0  # holds freed by their deadline, not by an acknowledgement
    pulls: int = 0  # pulls whose KV arrived (decode side)
    blocks_pulled: int = 0
    bytes_pulled: int = 0
    pull_seconds: float = 0.0  # summed over arrived pulls (slowest rank of each)
    fallbacks: int = 0  # requests that computed their prompt because KV did not arrive
    blocks_from_cache: int = 0  # source blocks the prefix cache already had (not pulled)
    refused_connections: int = 0  # peers that did not prove the deployment secret


class KvEndpoints:
    """Where each rank's kv_transfer actor serves, as they announce themselves."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self.by_rank: dict[int, TransferEndpoint] = {}

    def update(self, event: TransferEndpoint) -> None:
        self.by_rank[event.rank] = event

    @property
    def complete(self) -> bool:
        return len(self.by_rank) == self.num_ranks
