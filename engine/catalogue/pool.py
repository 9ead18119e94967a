"""The loaded models: each started on its first request, stopped when idle, within limits.

A request takes a `Lease` on its model (`acquire`): the model is loaded first if it is not (the
request waits; a bounded number may wait), and while any lease is held the model is never
unloaded. When the last lease of a model is released, its keep_alive (the last request's, else
the model's, else the server's) decides: 0 unloads it at once, a duration arms its expiry, a
negative one keeps it. A load that would pass `max_loaded` models, or the memory budget (the
sum of each loaded model's weights and KV cache), first unloads idle models, least recently
used first; when only busy models are left it waits for one to become idle. Loads run one at
a time, so two never spend the same room. A model whose load fails, or whose supervisor gives
up, answers with one error naming it and the reason, and leaves the others alone.

The pool knows nothing of HTTP or of actors: a model's engine is anything with the
`ModelEngine` methods, made by the factory the server gives it (engine/http/served.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Generic, Protocol, TypeVar

from engine.catalogue.entries import CatalogueEntry
from engine.request.outputs import EngineError

log = logging.getLogger("engine.catalogue")

WATCH_INTERVAL_S = 0.5  # how often expiries and failed engines are looked for


class ModelEngine(Protocol):
    async def start(self) -> None: ...
    async def stop(self, reason: str) -> None: ...
    def failure(self) -> str | None: ...  # why it can no longer serve (its supervisor gave up)
    def memory_bytes(self) -> int: ...  # its weights and KV cache, all ranks


M = TypeVar("M", bound=ModelEngine)


@dataclasses.dataclass(frozen=True)
class PoolLimits:
    max_loaded: int = 3
    memory_budget: int | None = None  # bytes; None: no budget
    keep_alive: float = 300.0  # seconds; math.inf: kept
    max_waiting: int = 64  # requests waiting for loads
    load_timeout: float = 600.0


@dataclasses.dataclass
class Slot(Generic[M]):
    """One catalogue entry's life in the pool."""

    entry: CatalogueEntry
    state: str = "unloaded"  # unloaded | loading | loaded | unloading | failed
    engine: M | None = None
    in_flight: int = 0
    last_used: float = 0.0
    keep_alive: float | None = None  # the latest request's (None: the model's or the server's)
    expires_at: float | None = None  # monotonic; None: not armed
    error: str | None = None  # why its last load failed, or why it stopped serving
    cause: Exception | None = None  # what made its last load fail
    memory: int = 0
    loads: int = 0
    unloads: int = 0
    load_seconds: float = 0.0  # over all loads
    last_load_seconds: float = 0.0
    loaded_at: float | None = None  # wall clock, for clients
    ready: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    @property
    def name(self) -> str:
        return self.entry.name

    def idle(self) -> bool:
        return self.state == "loaded" and self.in_flight == 0


class Lease(Generic[M]):
    """A request's hold on a loaded model; `release` once, when the request has ended."""

    def __init__(self, pool: ModelPool[M], slot: Slot[M]) -> None:
        assert slot.engine is not None
        self.engine: M = slot.engine
        self.name = slot.name
        self._pool = pool
        self._slot = slot
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._pool._released(self._slot)


class ModelPool(Generic[M]):
    def __init__(
        self,
        entries: Iterable[CatalogueEntry],
        make_engine: Callable[[CatalogueEntry, int | None], M],
        estimate: Callable[[CatalogueEntry], int],
        limits: PoolLimits,
        memory_now: Callable[[], int] | None = None,
    ) -> None:
        """`make_engine(entry, memory_room)`: an engine not started, whose KV cache is sized
        from `memory_room` bytes (None: from what the machine has); `estimate(entry)`: the
        least memory the model needs (its weights and one sequence's KV cache); `memory_now`:
        what the machine has free now (caps the room a budget leaves)."""
        self.slots: dict[str, Slot[M]] = {}
        self._names: dict[str, str] = {}
        for entry in entries:
            self.slots[entry.name] = Slot(entry)
            self._names.update(dict.fromkeys(entry.names, entry.name))
        self._make_engine = make_engine
        self._estimate = estimate
        self.limits = limits
        self._memory_now = memory_now
        self._load_lock = asyncio.Lock()
        self._changed = asyncio.Condition()  # a model became idle or was unloaded
        self._waiting = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._loads: dict[str, asyncio.Task[None]] = {}  # by model: the load under way
        self._watcher: asyncio.Task[None] | None = None
        self._closed = False

    # ---- names ------------------------------------------------------------------------------

    def canonical(self, name: str) -> str | None:
        """The catalogue name `name` (a name or an alias) stands for; None: no such model."""
        return self._names.get(name)

    def names(self) -> tuple[str, ...]:
        """Every name a request may use: each model's names, the catalogue's order."""
        return tuple(name for slot in self.slots.values() for name in slot.entry.names)

    @property
    def default_name(self) -> str:
        return next(iter(self.slots))

    def loaded(self) -> list[tuple[str, M]]:
        return [(s.name, s.engine) for s in self.slots.values() if s.engine is not None]

    # ---- life cycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the models marked for loading at start; then watch expiries and failures."""
        for slot in self.slots.values():
            if slot.entry.preload:
                await self._load(slot, keep_alive=math.inf, at_start=True)
                if slot.cause is not None:
                    raise slot.cause  # as a one-model server's start always said it
        self._watcher = asyncio.get_running_loop().create_task(self._watch(), name="models")

    async def close(self, reason: str = "shutdown requested") -> None:
        self._closed = True
        if self._watcher is not None:
            self._watcher.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        loaded = [slot for slot in self.slots.values() if slot.engine is not None]
        await asyncio.gather(*(self._stop(slot, reason) for slot in loaded))

    # ---- requests ---------------------------------------------------------------------------

    async def acquire(self, name: str, keep_alive: float | None = None) -> Lease[M]:
        """A lease on model `name`, loaded first if need be; EngineError (404: no such model,
        503: it cannot be loaded, or too many requests wait for loads)."""
        slot = self._slot(name)
        if slot.state != "loaded":
            await self._wait_loaded(slot, keep_alive)
        slot.in_flight += 1
        slot.expires_at = None
        slot.last_used = time.monotonic()
        slot.keep_alive = keep_alive  # as Ollama: the latest request's (None: the default)
        return Lease(self, slot)

    def _released(self, slot: Slot[M]) -> None:
        slot.in_flight -= 1
        slot.last_used = time.monotonic()
        if slot.in_flight == 0:
            self._became_idle(slot)

    def _became_idle(self, slot: Slot[M]) -> None:
        keep = self.keep_alive_of(slot)
        if keep == 0:
            self._spawn(self._unload(slot, "keep_alive 0: unloaded after its last request"))
        else:
            slot.expires_at = None if math.isinf(keep) else time.monotonic() + keep
        self._spawn(self._notify())

    def keep_alive_of(self, slot: Slot[M]) -> float:
        for keep in (slot.keep_alive, slot.entry.keep_alive):
            if keep is not None:
                return keep
        return math.inf if slot.entry.preload else self.limits.keep_alive

    # ---- by hand: /models/load, /models/unload, the admin socket, Ollama's empty prompts -------

    async def load(self, name: str, keep_alive: float | None = None) -> Slot[M]:
        slot = self._slot(name)
        if slot.state != "loaded":
            await self._wait_loaded(slot, keep_alive)
        if keep_alive is not None:
            slot.keep_alive = keep_alive
        if slot.in_flight == 0:
            self._became_idle(slot)
        return slot

    async def unload(self, name: str) -> Slot[M]:
        """Unload model `name` once its requests in flight have ended (new ones wait)."""
        slot = self._slot(name)
        await self._unload(slot, "unloaded by request")
        return slot

    # ---- internals --------------------------------------------------------------------------

    def _slot(self, name: str) -> Slot[M]:
        canonical = self._names.get(name)
        if canonical is None:
            listed = ", ".join(f"'{n}'" for n in self._names)
            raise EngineError(f"model '{name}' not found; this server has {listed}", 404, "model")
        return self.slots[canonical]

    async def _wait_loaded(self, slot: Slot[M], keep_alive: float | None) -> None:
        if self._closed:
            raise EngineError("the server is shutting down", 503)
        if self._waiting >= self.limits.max_waiting:
            raise EngineError(
                f"model '{slot.name}' is not loaded and {self._waiting} requests already wait "
                f"for models to load (models.max_waiting); try again later",
                503,
            )
        self._waiting += 1
        try:
            async with asyncio.timeout(self.limits.load_timeout):
                while slot.state != "loaded":
                    if slot.state in ("loading", "unloading"):
                        await self._state_change()
                    else:
                        # A load goes on if this request leaves: others may wait for it.
                        await asyncio.shield(self._load_task(slot, keep_alive))
                        if slot.state == "failed":
                            raise EngineError(f"model '{slot.name}' {slot.error}", 503, "model")
        except TimeoutError:
            raise EngineError(
                f"model '{slot.name}' was not loaded within {self.limits.load_timeout:g} s "
                "(models.load_timeout): the loaded models are busy",
                503,
            ) from None
        finally:
            self._waiting -= 1

    def _load_task(self, slot: Slot[M], keep_alive: float | None) -> asyncio.Task[None]:
        task = self._loads.get(slot.name)
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(self._load(slot, keep_alive))
            self._loads[slot.name] = task
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return task

    async def _load(self, slot: Slot[M], keep_alive: float | None, at_start: bool = False) -> None:
        """Load `slot`'s model; a failure is the slot's state. `at_start`: the failure stops the
        start, which says why in its one line, so it is not logged here as well."""
        async with self._load_lock:
            if slot.state == "loaded":
                return
            slot.state, slot.error, slot.cause = "loading", None, None
            began = time.monotonic()
            try:
                room = await self._make_room(slot)
                engine = self._make_engine(slot.entry, room)
                slot.engine = engine
                await engine.start()
            except asyncio.CancelledError:
                await self._discard(slot)
                raise
            except Exception as e:  # the model's own failure: it alone is failed
                if not at_start:
                    log.warning("model %s failed to load: %s", slot.name, e)
                await self._discard(slot)
                slot.state, slot.error, slot.cause = "failed", f"failed to load: {e}", e
                await self._notify()
                return
            took = time.monotonic() - began
            slot.state, slot.memory = "loaded", engine.memory_bytes()
            slot.loads += 1
            slot.load_seconds += took
            slot.last_load_seconds = took
            slot.loaded_at = time.time()
            slot.last_used = time.monotonic()
            slot.keep_alive = keep_alive
            log.info("model %s loaded in %.2f s (%.1f MiB)", slot.name, took, slot.memory / 2**20)
            await self._notify()

    async def _discard(self, slot: Slot[M]) -> None:
        engine, slot.engine = slot.engine, None
        slot.state = "unloaded"
        if engine is not None:
            with contextlib.suppress(Exception):
                await engine.stop("its load failed")

    async def _make_room(self, slot: Slot[M]) -> int | None:
        """Unload idle models (least recently used first) until one more model fits in the
        count and the budget; wait for busy ones to become idle when only they are left. The
        room the budget leaves, for the new model's KV cache (None: no budget)."""
        budget = self.limits.memory_budget
        # Off the event loop (it plans the model): the loaded models serve on meanwhile.
        needed = await asyncio.to_thread(self._estimate, slot.entry) if budget is not None else 0
        if budget is not None and needed > budget:
            raise EngineError(
                f"needs at least {needed / 2**20:.1f} MiB, more than the models' memory budget "
                f"of {budget / 2**20:.1f} MiB (models.memory)",
                503,
            )
        while True:
            others = [s for s in self.slots.values() if s is not slot and s.engine is not None]
            used = sum(s.memory for s in others)
            over_count = len(others) >= self.limits.max_loaded
            over_budget = budget is not None and used + needed > budget
            if not over_count and not over_budget:
                break
            idle = sorted((s for s in others if s.idle()), key=lambda s: s.last_used)
            if idle:
                why = "max_loaded" if over_count else "memory budget"
                await self._stop(idle[0], f"least recently used idle model ({why}: {slot.name})")
            else:
                await self._state_change()
        if budget is None:
            return None
        room = budget - used
        return min(room, self._memory_now()) if self._memory_now is not None else room

    async def _unload(self, slot: Slot[M], reason: str) -> None:
        while slot.state in ("loading", "unloading"):
            await self._state_change()
        if slot.engine is None:
            return
        slot.state = "unloading"  # new requests wait; those in flight finish
        while slot.in_flight:
            await self._state_change()
        await self._stop(slot, reason)

    async def _stop(self, slot: Slot[M], reason: str) -> None:
        engine, slot.engine = slot.engine, None
        slot.state = "unloading"
        log.info("model %s: unloading (%s)", slot.name, reason)
        if engine is not None:
            try:
                await engine.stop(reason)
            except Exception:
                log.exception("model %s: its engine failed to stop", slot.name)
        slot.unloads += 1
        slot.memory, slot.expires_at, slot.keep_alive = 0, None, None
        slot.state = "unloaded" if slot.error is None else "failed"
        await self._notify()

    async def _state_change(self) -> None:
        """Until a model's state changes (or a second passes: every waiter checks again)."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), 1.0)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _spawn(self, work: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self) -> None:
        """Unload models whose keep_alive ran out, and those whose supervisor gave up."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            now = time.monotonic()
            for slot in list(self.slots.values()):
                engine = slot.engine
                if slot.state != "loaded" or engine is None:
                    continue
                failure = engine.failure()
                if failure is not None:
                    slot.error = f"stopped serving: {failure}"
                    self._spawn(self._stop(slot, slot.error))
                elif slot.idle() and slot.expires_at is not None and now >= slot.expires_at:
                    self._spawn(self._unload(slot, "keep_alive expired"))
