"""One rank's tensor-parallel group: joining it (TCP store rendezvous) and the few collectives the
model needs: all-reduce (row-parallel outputs, vocabulary-parallel embedding), gather to rank 0
(logits), and the plan relay for ranks on other hosts (rank 0 broadcasts each step's frames).

gloo on CPU, NCCL on CUDA. A group of one is the same object with every collective a no-op, so
the model code has a single path.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch.distributed import Store, TCPStore  # type: ignore[attr-defined]  # not re-exported

log = logging.getLogger(__name__)

# A dead peer breaks its connections at once (an error, not a wait). A peer that is alive but
# never joins (stuck, or out of step after a failure) makes the model's collectives wait the
# group's bounded `collective_timeout_s` (a setting), then fail: the group restarts. Only the plan
# relay waits longer: ranks on another host wait there for the next plan however long the engine
# stays idle, so it runs on a group of its own.
RELAY_TIMEOUT = datetime.timedelta(days=7)
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0

_FRAMES = msgspec.msgpack.Encoder()
_FRAMES_DECODER = msgspec.msgpack.Decoder(list[bytes])


class CollectiveError(RuntimeError):
    """A collective failed (a rank died, a connection broke): the group's fault, never a
    request's; the worker must fail so that the group restarts."""


def _collective(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return call(*args, **kwargs)
    except RuntimeError as exc:  # gloo / NCCL report a broken peer as RuntimeError
        raise CollectiveError(f"{call.__name__} failed: {exc}") from exc


class TensorParallelGroup:
    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        device: torch.device | None = None,
        relay: Any = None,
    ) -> None:
        self.rank = rank
        self.size = size
        self.device = device or torch.device("cpu")
        self._relay = relay  # the plan relay's own process group (None: the default one)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place."""
        if self.size > 1:
            _collective(dist.all_reduce, x)
        return x

    def failed_ranks(self, failed: bool) -> list[int]:
        """Every rank says whether its part of a step failed; all learn which ranks did.

        Called by every rank at the same points of a step, so that they take the same path
        afterwards (run the step again piece by piece, or go on): a rank that went its own way
        would issue collectives the others never join."""
        if self.size == 1:
            return [0] if failed else []
        flags = torch.zeros(self.size, dtype=torch.int32, device=self.device)
        flags[self.rank] = int(failed)
        _collective(dist.all_reduce, flags)
        return [rank for rank, flag in enumerate(flags.tolist()) if flag]

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's x [rows, cols] side by side [rows, size * cols]; others: None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if not self.is_first:
            _collective(dist.gather, x, None, dst=0)
            return None
        parts = [torch.empty_like(x) for _ in range(self.size)]
        _collective(dist.gather, x, parts, dst=0)
        return torch.cat(parts, dim=-1)

    def broadcast_frames(self, frames: list[bytes]) -> None:
        """Rank 0: send one step's plan frames to every other rank (see receive_frames)."""
        payload = _FRAMES.encode(frames)
        length = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        _collective(dist.broadcast, length, src=0, group=self._relay)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        _collective(dist.broadcast, data, src=0, group=self._relay)

    def receive_frames(self) -> list[bytes]:
        """Ranks > 0: the frames rank 0 broadcast next (blocks until it does)."""
        length = torch.empty(1, dtype=torch.int64, device=self.device)
        _collective(dist.broadcast, length, src=0, group=self._relay)
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        _collective(dist.broadcast, payload, src=0, group=self._relay)
        return _FRAMES_DECODER.decode(payload.cpu().numpy().tobytes())

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def open_store(
    rank: int, size: int, master_addr: str, master_port: int, timeout_s: float
) -> TCPStore:
    """Rank 0 serves the store (port 0: any free port, read back from `store.port`); the others
    connect to it, retrying until it is up or `timeout_s` has passed."""
    return TCPStore(
        master_addr,
        master_port,
        world_size=size,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def wait_for_ranks(store: Store, size: int, timeout_s: float, where: str) -> None:
    """Count this rank in and wait until all `size` have; TimeoutError saying how many came.
    (The process group's own timeout is the collectives' very long one: not for start-up.)"""
    joined = store.add("ranks_joined", 1)
    deadline = time.monotonic() + timeout_s
    while joined < size:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"only {joined} of {size} tensor-parallel ranks joined at {where} within "
                f"{timeout_s:g} s (each host of the group must be started)"
            )
        time.sleep(0.05)
        joined = store.add("ranks_joined", 0)


def join_group(
    store: Store,
    rank: int,
    size: int,
    device: torch.device,
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    relay_plans: bool = False,
) -> TensorParallelGroup:
    """Form the process group over `store` (every rank is there: see wait_for_ranks), and the
    plan relay's group when the ranks span hosts."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    relay = dist.new_group(backend=backend, timeout=RELAY_TIMEOUT) if relay_plans else None
    log.info(
        "tensor-parallel rank %d of %d joined (%s on %s, collectives time out after %g s)",
        rank,
        size,
        backend,
        device,
        collective_timeout_s,
    )
    return TensorParallelGroup(rank, size, device, relay)
