"""Rank-by-rank reports of a transfer, added up: with TP each rank moves its own shard, so a
request's KV has arrived only when every rank's BlocksPulled says so, and a hold has ended
only when every rank's BlocksReleased came (or at its deadline, which the scheduler keeps).

The tally knows only the transfers it was told to expect: a report of another one (an older
attempt's, a duplicate, one that came after its transfer was decided) is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.messages.kv_transfer import BlocksPulled, BlocksReleased


@dataclass(frozen=True)
class PullOutcome:
    """A whole pull, every rank together: arrived when error is None."""

    transfer_id: str
    error: str | None
    num_bytes: int = 0  # all ranks'
    seconds: float = 0.0  # the slowest rank's
    via: str = ""  # the ranks' ways, e.g. "shm" or "shm+tcp"


@dataclass
class _Pending:
    ranks: set[int] = field(default_factory=set)
    num_bytes: int = 0
    seconds: float = 0.0
    via: set[str] = field(default_factory=set)


class PullTally:
    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._pending: dict[str, _Pending] = {}

    def expect(self, transfer_id: str) -> None:
        self._pending[transfer_id] = _Pending()

    def forget(self, transfer_id: str) -> None:
        self._pending.pop(transfer_id, None)

    def add(self, report: BlocksPulled) -> PullOutcome | None:
        """The pull's outcome once decided (the first error, or the last rank's success),
        once; None while undecided or for a transfer not expected."""
        pending = self._pending.get(report.transfer_id)
        if pending is None or not 0 <= report.rank < self.world_size:
            return None
        if report.error is not None:
            del self._pending[report.transfer_id]
            return PullOutcome(report.transfer_id, f"rank {report.rank}: {report.error}")
        if report.rank in pending.ranks:
            return None  # a duplicate counts once
        pending.ranks.add(report.rank)
        pending.num_bytes += report.num_bytes
        pending.seconds = max(pending.seconds, report.seconds)
        pending.via.add(report.via)
        if len(pending.ranks) < self.world_size:
            return None
        del self._pending[report.transfer_id]
        via = "+".join(sorted(pending.via))
        return PullOutcome(report.transfer_id, None, pending.num_bytes, pending.seconds, via)


class ReleaseTally:
    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._pending: dict[str, set[int]] = {}

    def expect(self, transfer_id: str) -> None:
        self._pending[transfer_id] = set()

    def forget(self, transfer_id: str) -> None:
        self._pending.pop(transfer_id, None)

    def add(self, report: BlocksReleased) -> bool:
        """True once, when the last rank of an expected hold has reported its release."""
        ranks = self._pending.get(report.transfer_id)
        if ranks is None or not 0 <= report.rank < self.world_size:
            return False
        ranks.add(report.rank)
        if len(ranks) < self.world_size:
            return False
        del self._pending[report.transfer_id]
        return True
