"""The kv_transfer actor, one per worker rank: serves the blocks its scheduler holds to pullers
on other instances, and pulls blocks from them into its own rank's cache (prefill/decode
disaggregation: engine/messages/kv_transfer.py).

Orders come on KV_ORDERS_RING (HoldBlocks, DropHolds, PullBlocks); events go out on
its rank's KV_EVENTS_RING (TransferEndpoint at every start, BlocksReleased, BlocksPulled,
ConnectionsRefused). Every connection, either way, first proves the deployment secret. The cache is
the worker's shared-memory segment, mapped here too. The domain work is engine.kv.transfer;
sockets are served and pulls run on threads, so the loop (and its heartbeats) stays free while
gigabytes move.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from engine.actors.configs import KvTransferConfig
from engine.kv.transfer.cache_view import CacheView
from engine.kv.transfer.holds import HoldTable
from engine.kv.transfer.host import host_id
from engine.kv.transfer.puller import Puller
from engine.kv.transfer.refusals import RefusalLog
from engine.kv.transfer.secret import deployment_secret
from engine.kv.transfer.segment import Segments
from engine.kv.transfer.server import BlockServer
from engine.kv.transfer.tls import TlsFiles
from engine.messages.kv_transfer import (
    KV_ORDERS,
    BlocksReleased,
    ConnectionsRefused,
    DropHolds,
    HoldBlocks,
    KvEndpoint,
    PullBlocks,
    TransferEndpoint,
)
from engine.messages.ring_catalogue import KV_EVENTS_RING, KV_ORDERS_RING
from engine.messages.roles import Role
from engine.runtime.actor import Actor
from engine.runtime.hooks import install_hooks
from engine.runtime.segments import map_segment
from engine.runtime.shm import SEGMENT_PREFIX, SHM_DIR
from engine.settings.home import default_engine_home

T = TypeVar("T")
MAX_CONNECTIONS = 64  # served at once (a thread each); more are closed at once
ACCEPT_RETRY = 0.1  # seconds before accepting again after accept failed


class KvTransferActor(Actor):
    channels = (KV_ORDERS,)
    role = Role.KV_TRANSFER
    # Seconds each pull waits before it starts: only a test's hook sets it (engine/testing/)
    pull_delay = 0.0

    async def on_start(self) -> dict[str, Any] | None:
        config = msgspec.msgpack.decode(self.config, type=KvTransferConfig)
        self.settings = config
        self.events = KV_EVENTS_RING.at(config.rank)
        if config.cache_segment not in self.segments:
            raise KeyError(f"no segment {config.cache_segment!r}; mapped: {list(self.segments)}")
        segment = self.segments[config.cache_segment]
        self.view = CacheView(config.layout, map_segment(segment))
        self.holds = HoldTable()
        install_hooks("kv_transfer", self)  # a test's pull delay, if it asked for one
        here = host_id(SHM_DIR)
        self._open_transfers(config, segment, here)
        self._listener = socket.create_server((config.listen_host, config.port), backlog=64)
        self._listener.setblocking(False)
        port = self._listener.getsockname()[1]
        self.endpoint = KvEndpoint(config.advertised_host or config.listen_host, port, here)
        self._hold_added = asyncio.Event()
        self._pulls: set[asyncio.Task[None]] = set()
        self._connections = threading.BoundedSemaphore(MAX_CONNECTIONS)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._accept(), name="accept"),
            loop.create_task(self._report_releases(), name="releases"),
            loop.create_task(self._report_refusals(), name="refusals"),
            loop.create_task(self._expire_holds(), name="expiry"),
        ]
        for task in self._tasks:
            task.add_done_callback(self._on_task_done)
        await self._announce()
        return {"cache_segment": segment, "port": port}

    def _open_transfers(self, config: KvTransferConfig, segment: Any, here: str) -> None:
        """The server of this rank's blocks and the puller of others', both proving the
        deployment secret (and speaking TLS when its files are given)."""
        loop = asyncio.get_running_loop()
        secret = config.secret or deployment_secret(
            one_launch=False, secret_file=None, home=default_engine_home(), environ=os.environ
        )
        tls = TlsFiles(config.tls_cert, config.tls_key, config.tls_ca)
        self._released: asyncio.Queue[str] = asyncio.Queue()
        self._refused: asyncio.Queue[str] = asyncio.Queue()

        def on_thread(queue: asyncio.Queue[str]) -> Callable[[str], None]:
            def put(item: str) -> None:  # on a connection's thread
                with contextlib.suppress(RuntimeError):  # the loop closed: the actor is ending
                    loop.call_soon_threadsafe(queue.put_nowait, item)

            return put

        self.server = BlockServer(
            self.view,
            segment,
            self.holds,
            here,
            on_thread(self._released),
            secret=secret,
            on_refused=on_thread(self._refused),
            tls=tls.server_context() if tls.enabled else None,
            idle_timeout=config.idle_timeout,
        )
        self.puller = Puller(
            self.view,
            here,
            secret=secret,
            segments=Segments(SHM_DIR, SEGMENT_PREFIX),
            tls=tls.client_context() if tls.enabled else None,
            force_tcp=config.force_tcp,
        )

    async def handle(self, ring: str, frames: list[bytes]) -> None:
        for order in KV_ORDERS_RING.decode_many(frames):  # its one inbound ring
            if isinstance(order, HoldBlocks):
                self._hold(order)
            elif isinstance(order, DropHolds):
                self.holds.drop(order.transfer_ids, "the scheduler dropped its hold")
            elif isinstance(order, PullBlocks):
                task = asyncio.get_running_loop().create_task(self._pull(order))
                self._pulls.add(task)
                task.add_done_callback(self._pulls.discard)

    async def on_rings_swapped(self, peer: str, rings: list[str]) -> None:
        if (
            KV_ORDERS_RING.name in rings
        ):  # a restarted scheduler forgot its holds: their blocks are free
            self.holds.drop_all(f"{peer} restarted")
        if self.events.name in rings:
            await self._announce()

    async def on_stop(self) -> None:
        self._listener.close()
        self.puller.connections.close()
        for task in [*self._tasks, *self._pulls]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._pulls, return_exceptions=True)

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        # These tasks run for the actor's whole life: one that ends takes the actor down (its
        # supervisor restarts it), rather than leaving it alive but deaf.
        if not task.cancelled():
            self.stop(f"task {task.get_name()!r} ended: {task.exception()!r}")

    def _hold(self, order: HoldBlocks) -> None:
        try:
            self.view.check_block_ids(order.block_ids, "held")
        except ValueError as exc:
            self.log.error("ignored HoldBlocks %r: %s", order.transfer_id, exc)
            return
        self.holds.hold(order.transfer_id, order.block_ids, order.deadline)
        self._hold_added.set()

    async def _announce(self) -> None:
        message = TransferEndpoint(self.settings.rank, self.endpoint, self.settings.layout)
        await self.send_to(self.events, message)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                connection, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # out of descriptors, a connection reset before accept
                self.log.warning("accept failed: %s", exc)
                await asyncio.sleep(ACCEPT_RETRY)
                continue
            if not self._connections.acquire(blocking=False):
                self.log.warning("refused a connection: %d are being served", MAX_CONNECTIONS)
                connection.close()
                continue
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve_connection, args=(connection,), daemon=True).start()

    def _serve_connection(self, connection: socket.socket) -> None:  # on its own thread
        try:
            self.server.serve(connection)
        finally:
            self._connections.release()

    async def _report_releases(self) -> None:
        while True:
            transfer_id = await self._released.get()
            released = BlocksReleased(transfer_id, self.settings.rank)
            await self.send_to(self.events, released)

    async def _report_refusals(self) -> None:
        """Each refused connection counted (one event for those that came together) and logged
        once per peer per minute."""
        refusals = RefusalLog()
        while True:
            peers = [await self._refused.get()]
            while not self._refused.empty():
                peers.append(self._refused.get_nowait())
            for peer in peers:
                count = refusals.note(peer, time.monotonic())
                if count is not None:
                    self.log.warning(
                        "refused %d kv_transfer connection(s) from %s: the peer did not prove "
                        "the deployment secret (logged once a minute per peer)",
                        count,
                        peer,
                    )
            refused = ConnectionsRefused(self.settings.rank, len(peers))
            await self.send_to(self.events, refused)

    async def _expire_holds(self) -> None:
        """Drop each hold at its deadline (a pull of it is refused from then on anyway)."""
        while True:
            deadline = self.holds.next_deadline()
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._hold_added.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._hold_added.wait(), timeout)
            for transfer_id in self.holds.expire():
                self.log.info("hold of %r expired", transfer_id)

    async def _pull(self, order: PullBlocks) -> None:
        if self.pull_delay:  # tests only: a kill then lands while the pull is under way
            await asyncio.sleep(self.pull_delay)
        outcome = await _on_daemon_thread(self.puller.pull, order, self.settings.rank)
        if outcome.error is not None:
            self.log.warning("%s", outcome.error)
        await self.send_to(self.events, outcome)


async def _on_daemon_thread(function: Callable[..., T], *args: Any) -> T:
    """`function(*args)` on a thread of its own that does not hold up the process's exit (as
    asyncio.to_thread's would: a pull waits up to its deadline, minutes maybe)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():  # cancelled meanwhile
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        result, error = None, None
        try:
            result = function(*args)
        except BaseException as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, daemon=True).start()
    return await done
