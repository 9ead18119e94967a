"""Channel scheduler -> root: what the admin socket, /health and /metrics show of the scheduler."""

from __future__ import annotations

import msgspec

from engine.messages.codec import Channel
from engine.messages.scheduling import RequestStatus, SchedulerStats


class SchedulerReport(msgspec.Struct, tag=True):
    stats: SchedulerStats
    requests: list[RequestStatus]


SCHEDULER_REPORTS: Channel[SchedulerReport] = Channel("scheduler-reports", SchedulerReport)
