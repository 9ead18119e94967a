"""A TP transfer's rank reports added up: arrived only when every rank says so, failed at the
first rank's error, decided once, and reports of transfers not expected are ignored."""

from __future__ import annotations

from engine.kv_transfer.tally import PullOutcome, PullTally, ReleaseTally
from engine.messages.kv_transfer import BlocksPulled, BlocksReleased


def ok(rank: int, transfer_id: str = "r@1", seconds: float = 1.0) -> BlocksPulled:
    return BlocksPulled(transfer_id, rank, None, 100, seconds, "shm" if rank else "tcp")


def test_a_pull_arrives_only_when_every_rank_reported_it() -> None:
    tally = PullTally(world_size=3)
    tally.expect("r@1")

    assert tally.add(ok(0, seconds=0.5)) is None
    assert tally.add(ok(0, seconds=0.5)) is None  # a duplicate counts once
    assert tally.add(ok(2, seconds=2.0)) is None
    outcome = tally.add(ok(1))

    assert outcome == PullOutcome("r@1", None, 300, 2.0, "shm+tcp")
    assert tally.add(ok(1)) is None  # decided: later reports change nothing


def test_one_ranks_error_fails_the_pull_once() -> None:
    tally = PullTally(world_size=2)
    tally.expect("r@1")

    assert tally.add(ok(0)) is None
    failed = tally.add(BlocksPulled("r@1", 1, "the source refused it", 0, 0.1, "tcp"))

    assert failed == PullOutcome("r@1", "rank 1: the source refused it")
    assert tally.add(ok(1)) is None


def test_reports_of_transfers_not_expected_are_ignored() -> None:
    tally = PullTally(world_size=1)
    tally.expect("r@2")

    assert tally.add(ok(0, transfer_id="r@1")) is None  # an older attempt's
    assert tally.add(ok(5, transfer_id="r@2")) is None  # no such rank
    tally.forget("r@2")
    assert tally.add(ok(0, transfer_id="r@2")) is None


def test_a_hold_ends_when_every_rank_reported_its_release() -> None:
    tally = ReleaseTally(world_size=2)
    tally.expect("r@1")

    assert not tally.add(BlocksReleased("r@1", 1))
    assert not tally.add(BlocksReleased("r@1", 1))
    assert not tally.add(BlocksReleased("r@0", 0))
    assert tally.add(BlocksReleased("r@1", 0))
    assert not tally.add(BlocksReleased("r@1", 0))
