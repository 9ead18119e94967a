"""Channel supervisor <-> actor: what the root tells a child and what a child reports back.

Every child has two private rings to the root, both renewed with each generation of the child:
`control` (root -> child: Stop, SwapRings, LogLevel) and `status` (child -> root: Ready,
Heartbeat, SwapDone, Exiting). A child is started with one `ChildBoot`: plain data, the only
thing the spawned process receives (besides what `spawn` itself needs to call the entry function).
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.messages.codec import Channel
from engine.messages.rings import RingSpec


class InboundRing(msgspec.Struct, frozen=True, array_like=True):
    """A ring this party reads; `reader` is its index on a broadcast ring (0 on an SPSC ring)."""

    spec: RingSpec
    reader: int = 0


class ChildBoot(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a spawned child needs to run its actor."""

    name: str
    entry: str  # "module:Class" of an engine.runtime.actor.Actor subclass
    config: bytes  # the actor's own settings, encoded by whoever built the ChildSpec
    root_pid: int  # the child exits when this process is gone
    generation: int  # 0 at first start, +1 per restart
    control: RingSpec  # root -> child
    status: RingSpec  # child -> root
    inbound: dict[str, InboundRing]  # logical ring name -> ring this actor reads
    outbound: dict[str, RingSpec]  # logical ring name -> ring this actor writes
    heartbeat_interval: float  # seconds between Heartbeats
    log_level: str
    segments: dict[str, str] = {}  # logical segment name -> shared-memory name (SegmentDecl)
    # The root's run directory in /dev/shm (owner-only), where an actor may keep files for its
    # successors; its name is the run's random token.
    run_dir: str = ""


# root -> child


class Stop(msgspec.Struct, tag=True, array_like=True):
    """Finish: run on_stop, report Exiting, exit with status 0."""

    reason: str


class SwapRings(msgspec.Struct, tag=True, array_like=True):
    """`peer` was restarted: these of your rings were replaced by fresh segments; use them.

    Answered with SwapDone(swap_id) once the old ends are closed: from then on nothing this
    actor writes can land in a retired ring.
    """

    swap_id: int
    peer: str
    inbound: dict[str, InboundRing]
    outbound: dict[str, RingSpec]


class LogLevel(msgspec.Struct, tag=True, array_like=True):
    level: str  # a logging level name: DEBUG, INFO, WARNING, ERROR, CRITICAL


# child -> root


class Ready(msgspec.Struct, tag=True, array_like=True):
    """on_start finished; `info` is what the actor reported (e.g. KV blocks it could allocate)."""

    pid: int
    info: dict[str, Any]


class Heartbeat(msgspec.Struct, tag=True, array_like=True):
    seq: int
    decode_errors: int  # malformed frames dropped so far (all of the actor's channels)
    # Written so far by this process, by outbound ring (logical name): frames and bytes
    frames_sent: dict[str, int] = msgspec.field(default_factory=dict)
    bytes_sent: dict[str, int] = msgspec.field(default_factory=dict)
    # How full each outbound ring is at this beat (0 to 1): a sample, not a peak
    ring_fill: dict[str, float] = msgspec.field(default_factory=dict)
    loop_lag: float = 0.0  # seconds since the actor's event loop last turned
    busy_for: float = 0.0  # seconds inside busy() (a model step); 0: not busy
    busy_limit: float = 0.0  # the deadline that work was given, in seconds; 0: none


class SwapDone(msgspec.Struct, tag=True, array_like=True):
    swap_id: int


class Exiting(msgspec.Struct, tag=True, array_like=True):
    """Sent last, on the way out (a requested stop, SIGTERM, or a crash the actor caught)."""

    reason: str


ControlMessage = Stop | SwapRings | LogLevel
StatusMessage = Ready | Heartbeat | SwapDone | Exiting

CONTROL: Channel[ControlMessage] = Channel("control", ControlMessage)
STATUS: Channel[StatusMessage] = Channel("status", StatusMessage)
BOOT: Channel[ChildBoot] = Channel("child-boot", ChildBoot)
