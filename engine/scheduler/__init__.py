"""The scheduler's domain: continuous batching over the paged KV cache, sequences, admission
and stopping (plain Python, no I/O; the actor around it is engine/actors/scheduler.py)."""

from engine.scheduler.config import SchedulerConfig
from engine.scheduler.scheduler import Scheduler

__all__ = ["Scheduler", "SchedulerConfig"]
