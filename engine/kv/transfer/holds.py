"""The blocks a server holds for pullers: one hold per transfer id, until acknowledged, dropped
by the scheduler, or past its deadline. Shared by the actor's loop (orders) and its connection
threads (pulls, acknowledgements), hence the lock."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable

_REMEMBERED = 4096  # ended transfer ids kept to say why a late pull fails


class Hold:
    __slots__ = ("block_ids", "blocks", "deadline")

    def __init__(self, block_ids: list[int], deadline: float) -> None:
        self.block_ids = block_ids
        self.blocks = frozenset(block_ids)
        self.deadline = deadline


class HoldTable:
    def __init__(self) -> None:
        self._holds: dict[str, Hold] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # transfer id -> why it ended
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a hold was added

    def __len__(self) -> int:
        return len(self._holds)

    def hold(self, transfer_id: str, block_ids: list[int], deadline: float) -> None:
        with self._lock:
            self._ended.pop(transfer_id, None)
            self._holds[transfer_id] = Hold(block_ids, deadline)
            self._changed.notify_all()

    def drop(self, transfer_ids: Iterable[str], why: str) -> None:
        with self._lock:
            for transfer_id in transfer_ids:
                if self._holds.pop(transfer_id, None) is not None:
                    self._remember(transfer_id, why)

    def drop_all(self, why: str) -> None:
        self.drop(list(self._holds), why)

    def expire(self, now: float | None = None) -> list[str]:
        """Drop every hold past its deadline; their ids."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [tid for tid, hold in self._holds.items() if hold.deadline <= now]
            for transfer_id in expired:
                del self._holds[transfer_id]
                self._remember(transfer_id, "its hold expired")
        return expired

    def next_deadline(self) -> float | None:
        with self._lock:
            return min((hold.deadline for hold in self._holds.values()), default=None)

    def check(
        self,
        transfer_id: str,
        block_ids: Iterable[int],
        now: float | None = None,
        arrival: float = 0.0,
    ) -> Hold:
        """The live hold of `transfer_id` covering `block_ids`; ValueError saying what is not.
        A transfer never heard of is waited for up to `arrival` seconds: its puller may have
        been quicker than the order that holds it (they travel different paths)."""
        with self._lock:
            if transfer_id not in self._holds and transfer_id not in self._ended:
                self._changed.wait_for(lambda: transfer_id in self._holds, arrival)
            hold = self._live(transfer_id, time.monotonic() if now is None else now)
        missing = [block for block in block_ids if block not in hold.blocks]
        if missing:
            raise ValueError(
                f"transfer {transfer_id!r} does not hold block(s) {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''} (it holds {len(hold.blocks)} blocks)"
            )
        return hold

    def acknowledge(self, transfer_id: str, now: float | None = None) -> None:
        """End a hold its puller acknowledged; ValueError if it was no longer valid, in which
        case what the puller copied may have been overwritten."""
        with self._lock:
            self._live(transfer_id, time.monotonic() if now is None else now)
            del self._holds[transfer_id]
            self._remember(transfer_id, "it was acknowledged already")

    def _live(self, transfer_id: str, now: float) -> Hold:
        hold = self._holds.get(transfer_id)
        if hold is None:
            why = self._ended.get(transfer_id, "it is unknown here")
            raise ValueError(f"transfer {transfer_id!r} is not held: {why}")
        if hold.deadline <= now:
            del self._holds[transfer_id]
            self._remember(transfer_id, "its hold expired")
            raise ValueError(f"transfer {transfer_id!r} is not held: its hold expired")
        return hold

    def _remember(self, transfer_id: str, why: str) -> None:
        self._ended[transfer_id] = why
        self._ended.move_to_end(transfer_id)
        while len(self._ended) > _REMEMBERED:
            self._ended.popitem(last=False)
