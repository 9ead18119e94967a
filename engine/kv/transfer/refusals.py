"""Connections refused for want of the deployment secret: counted, and logged at most once per
peer address per interval (a scan or a misconfigured instance must not flood the log)."""

from __future__ import annotations

LOG_INTERVAL_S = 60.0
_PEERS_KEPT = 4096  # addresses remembered; beyond, the oldest entries are forgotten


class RefusalLog:
    def __init__(self, interval: float = LOG_INTERVAL_S) -> None:
        self.interval = interval
        self._last: dict[str, tuple[float, int]] = {}  # peer -> (last logged, refused since)

    def note(self, peer: str, now: float) -> int | None:
        """Count one refusal of `peer`; the refusals to log now (this one included), or None
        while the peer was logged less than `interval` ago."""
        logged, since = self._last.get(peer, (float("-inf"), 0))
        if now - logged < self.interval:
            self._last[peer] = (logged, since + 1)
            return None
        self._last.pop(peer, None)  # re-inserted last: the dict stays in order of logging
        self._last[peer] = (now, 0)
        while len(self._last) > _PEERS_KEPT:
            del self._last[next(iter(self._last))]
        return since + 1
