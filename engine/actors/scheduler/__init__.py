"""Scheduler domain logic: continuous batching over the paged KV cache (no I/O here)."""

from engine.actors.scheduler.config import SchedulerConfig
from engine.actors.scheduler.scheduler import Scheduler

__all__ = ["Scheduler", "SchedulerConfig"]
