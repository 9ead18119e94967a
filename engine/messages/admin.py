"""Replies of the admin socket (and of AsyncLLM's health, stats, actors and requests): typed,
encoded as JSON objects with these field names."""

from __future__ import annotations

import msgspec

from engine.messages.scheduling import SchedulerFigures


class Health(msgspec.Struct, kw_only=True):
    ready: bool  # every actor runs and the engine has not given up
    not_ready: list[str]  # actors starting or restarting
    reason: str | None  # why the engine gave up, once it has
    draining: bool = False


class ActorRow(msgspec.Struct, kw_only=True):
    name: str
    role: str
    pid: int | None
    state: str
    restarts: int
    last_restart_reason: str
    generation: int
    model: str = ""  # the model whose actor it is (the server's name for it)


class RequestRow(msgspec.Struct, kw_only=True):
    request_id: str
    state: str  # held | tokenizing | prefilling | decoding
    epoch: int
    prompt_tokens: int
    generated_tokens: int
    strikes: int  # actor crashes it was in flight at since it last made progress
    age_s: float
    replica: int | None = None  # with data parallelism: the replica serving it
    model: str = ""  # the model it runs on


class RingTraffic(msgspec.Struct, kw_only=True):
    """What one actor (all its generations) has written to one of its outbound rings."""

    actor: str
    ring: str
    frames: int
    bytes: int
    fill: float = 0.0  # how full the ring was at the actor's last heartbeat (0 to 1)


class ReplicaRow(SchedulerFigures, kw_only=True):
    """One data-parallel replica: its state and load, and its scheduler's figures."""

    replica: int
    state: str  # running | failed
    in_flight: int
    pending_tokens: int
    routed_requests: int = 0
    reason: str | None = None  # why it failed
    role: str = "both"  # P/D: prefill | decode | both


class EngineStats(SchedulerFigures, kw_only=True):
    """The engine's figures: every scheduler's (summed; fractions averaged) and the root's."""

    in_flight: int
    resubmitted_requests: int
    stalled_stream_aborts: int
    restarts: dict[str, int]  # by actor
    kv_cache_blocks: int
    replicas: list[ReplicaRow]
    draining: bool = False
    ring_traffic: list[RingTraffic] = msgspec.field(default_factory=list)
    # CPU seconds of each actor's current process (a restart starts it over), and the root's
    actor_cpu: dict[str, float] = msgspec.field(default_factory=dict)
    # Seconds from each actor's deaths to its next generations ready, summed over its restarts
    actor_recovery_seconds: dict[str, float] = msgspec.field(default_factory=dict)
