"""Run the server: engine + uvicorn (uvloop) + admin socket on one event loop, drain on signals.

Start-up binds the port first (a busy port fails in a second, not after the model loads), starts
the engine, then serves and prints one line with the URL. SIGINT/SIGTERM (or the admin
`shutdown` command) drains: new requests get 503, in-flight ones get `server.drain_timeout`
seconds to finish, the rest are aborted, and everything the run created is removed. A second
signal skips the wait.

For a service manager: server.pidfile is held locked for the root's life (pidfile.py), and under
systemd's Type=notify the root sends READY=1, WATCHDOG=1 pings from its event loop and STOPPING=1
(service_notify.py; deploy/systemd/).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import stat
import sys
from collections.abc import Generator
from pathlib import Path
from typing import Any

import uvicorn
import uvloop

from engine.catalogue.pool import ModelPool
from engine.http.admin.paths import prepare_default_socket
from engine.http.admin.server import AdminServer
from engine.http.app import build_app
from engine.http.connections import KEEP_ALIVE_S, guarded_http_protocol
from engine.http.pidfile import PidFile
from engine.http.request_log import log_stats_forever
from engine.http.served import ServedModel, pool_health
from engine.http.service_notify import ServiceNotifier, stop_keep_alive
from engine.http.state import ServerState
from engine.launch.run_files import remove_run_files
from engine.settings import Settings

log = logging.getLogger("engine.http")

# How long uvicorn waits for connections after the drain before cancelling them.
_CONNECTION_GRACE_S = 5.0


TICK_S = 1.0  # uvicorn's main loop period (its own is 0.1 s)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (the launcher owns SIGINT/SIGTERM), ticking once a
    second instead of ten times."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def main_loop(self) -> None:
        # uvicorn's tick refreshes the Date header (once a second) and checks should_exit: ten
        # timer wakeups a second were most of an idle root's CPU. The counter steps by ten so
        # that every tick refreshes the header; exiting notices should_exit within TICK_S.
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 10) % 864000
            await asyncio.sleep(TICK_S)


def serve_forever(settings: Settings) -> int:
    _configure_logging(settings.runtime.log_level)
    return uvloop.run(_serve(settings))


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    uvicorn_level = "DEBUG" if level == "debug" else "WARNING"
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).setLevel(uvicorn_level)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=2048)
    sock.setblocking(False)
    return sock


def _bind_uds(path: str) -> socket.socket:
    """A Unix socket for HTTP (--uds), owner-only. A socket file left by a dead run is replaced;
    one a live server still answers on, or anything there that is no socket (a file, a
    directory, a link), is not touched: the start is refused naming it."""
    target = Path(path).expanduser()
    try:
        found = target.lstat().st_mode
    except FileNotFoundError:
        found = None
    if found is not None:
        if not stat.S_ISSOCK(found):
            raise OSError(f"{target} exists and is not a socket; not removing it")
        if _answers(target):
            raise OSError(f"a server is listening on {target}")
        target.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Bound under a umask that leaves the socket owner-only from its first moment, not after a
    # chmod (connecting needs write permission on a Unix socket).
    previous = os.umask(0o177)
    try:
        sock.bind(str(target))
    finally:
        os.umask(previous)
    try:
        os.chmod(target, 0o600)  # whatever another thread did to the umask meanwhile
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
        return True


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Shutdown:
    """First signal: drain. Second: stop waiting for in-flight requests."""

    def __init__(self) -> None:
        self.requested = asyncio.Event()
        self.forced = asyncio.Event()

    def request(self) -> None:
        if self.requested.is_set():
            self.forced.set()
        self.requested.set()


async def _serve(settings: Settings) -> int:
    """Serve while holding server.pidfile, if one is set (refused in one line if held)."""
    try:
        pidfile = PidFile.hold(settings.server.pidfile) if settings.server.pidfile else None
    except OSError as e:
        print(f"engine: {e}", file=sys.stderr)
        return 1
    try:
        return await _serve_holding_pidfile(settings)
    finally:
        if pidfile is not None:
            pidfile.release()


async def _serve_holding_pidfile(settings: Settings) -> int:
    server_cfg = settings.server
    try:
        sock = (
            _bind_uds(server_cfg.uds) if server_cfg.uds else _bind(server_cfg.host, server_cfg.port)
        )
    except OSError as e:
        where = server_cfg.uds or f"{server_cfg.host}:{server_cfg.port}"
        print(f"engine: cannot listen on {where}: {e}", file=sys.stderr)
        return 1
    try:
        admin_path, owned_dir = _admin_socket_path(settings)
    except OSError as e:
        sock.close()
        print(f"engine: cannot prepare the admin socket directory: {e}", file=sys.stderr)
        return 1
    shutdown = _Shutdown()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, shutdown.request)
    try:
        return await _run(settings, sock, admin_path, shutdown)
    finally:
        sock.close()
        if server_cfg.uds:
            with contextlib.suppress(OSError):
                Path(server_cfg.uds).expanduser().unlink()
        if owned_dir is not None:
            shutil.rmtree(owned_dir, ignore_errors=True)


async def _run(
    settings: Settings, sock: socket.socket, admin_path: Path, shutdown: _Shutdown
) -> int:
    try:
        state = ServerState.create(settings)  # the catalogue: --model, --models-dir
    except (OSError, ValueError) as e:
        print(f"engine: {e}", file=sys.stderr, flush=True)
        return 1
    if state.tenants.enabled:  # the tenants file is read again without a restart
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, state.tenants.reload_on_signal)
    models = state.models
    if not await _start_engine(models, shutdown):
        return 0 if shutdown.requested.is_set() else 1
    for name, served in models.loaded():
        log.info("model %s: sampling defaults: %s", name, served.llm.policy.describe_defaults())
    background = [] if settings.server.disable_log_stats else [log_stats_forever(state)]
    stats_tasks = [asyncio.create_task(work) for work in background]

    url = _listening_url(settings, sock)
    admin = _admin_server(state, admin_path, shutdown, url)
    server = _http_server(state, settings)
    serve_task: asyncio.Task[None] | None = None
    keep_alive: asyncio.Task[None] | None = None
    exit_status = 0
    try:
        try:
            await admin.start()
        except OSError as e:
            print(f"engine: cannot create admin socket {admin_path}: {e}", file=sys.stderr)
            return 1
        serve_task = await _start_serving(server, sock)
        print(
            f"engine ready: {url} (model {state.model_name}; admin socket {admin_path})", flush=True
        )
        service = ServiceNotifier.from_environ(os.environ, os.getpid())  # systemd, if under it
        service.ready(f"serving {url}")
        keep_alive = service.start_keep_alive()
        exit_status = await _serve_until_stopped(state, serve_task, shutdown)
        service.stopping("draining in-flight requests")
        log.info("shutting down: draining in-flight requests")
        await _drain(state, shutdown)
    finally:
        await stop_keep_alive(keep_alive)
        for task in stats_tasks:
            task.cancel()
        server.should_exit = True
        if serve_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(serve_task, _CONNECTION_GRACE_S + 5.0)
        await admin.close()
        with contextlib.suppress(Exception):
            await models.close()
        remove_run_files()  # the models' restart files: the run's, not one model's
        if state.trace is not None:
            state.trace.close()
    return exit_status


def _listening_url(settings: Settings, sock: socket.socket) -> str:
    if settings.server.uds:
        return f"unix:{settings.server.uds}"
    return _url(settings.server.host, sock.getsockname()[1])


def _admin_server(state: ServerState, path: Path, shutdown: _Shutdown, url: str) -> AdminServer:
    """The admin socket: it drains and stops this server, and says which server it is."""

    async def drain() -> dict[str, Any]:
        await _drain(state, shutdown)
        return {"drained": True, "in_flight": len(_requests_in_flight(state))}

    identity = {"pid": os.getpid(), "url": url, "model": state.model_name}
    return AdminServer(state, path, drain=drain, shutdown=shutdown.request, identity=identity)


async def _start_serving(server: _Server, sock: socket.socket) -> asyncio.Task[None]:
    """uvicorn serving on `sock`, once it has started; raises what stopped it before that."""
    serve_task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serve_task.done():
        await asyncio.sleep(0.01)
    if serve_task.done():
        serve_task.result()  # raises what stopped uvicorn
    return serve_task


def _http_server(state: ServerState, settings: Settings) -> _Server:
    """uvicorn around the app, with the connection guards (connections.py) as its protocol."""
    return _Server(
        uvicorn.Config(
            build_app(state),
            lifespan="off",
            root_path=settings.server.root_path,
            log_config=None,
            access_log=settings.runtime.log_level == "debug",
            timeout_graceful_shutdown=int(_CONNECTION_GRACE_S),
            timeout_keep_alive=KEEP_ALIVE_S,
            http=guarded_http_protocol(
                settings.server.header_timeout,
                settings.server.max_connections,
                settings.server.send_buffer,
                settings.server.body_timeout,
                settings.server.max_connections_per_client,
            ),
            ws="none",  # no websocket routes; an upgrade would also escape the head deadline
        )
    )


async def _serve_until_stopped(
    state: ServerState, serve_task: asyncio.Task[None], shutdown: _Shutdown
) -> int:
    """Until a stop is asked (0), the engine gives up or the HTTP server stops (1, said)."""
    stop_waiter = asyncio.create_task(shutdown.requested.wait())
    engine_failed = asyncio.create_task(_engine_failure(state))
    waiters = {serve_task, stop_waiter, engine_failed}
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    stop_waiter.cancel()
    engine_failed.cancel()
    if engine_failed.done() and not engine_failed.cancelled():
        print(f"engine: stopped: {engine_failed.result()}", file=sys.stderr, flush=True)
        return 1
    if serve_task.done():
        print("engine: the HTTP server stopped unexpectedly", file=sys.stderr, flush=True)
        return 1
    return 0


async def _engine_failure(state: ServerState, interval: float = 0.5) -> str:
    """Return why, once the engine has given up (its supervisor escalated past restarts): a
    one-model server's only model (a catalogue's failed model is that model's state)."""
    while True:
        reason = pool_health(state.models).reason
        if reason:
            return str(reason)
        await asyncio.sleep(interval)


async def _start_engine(models: ModelPool[ServedModel], shutdown: _Shutdown) -> bool:
    """Start the models loaded at start unless a signal comes first; say why in one line if
    that fails."""
    start = asyncio.create_task(models.start())
    stop_waiter = asyncio.create_task(shutdown.requested.wait())
    await asyncio.wait({start, stop_waiter}, return_when=asyncio.FIRST_COMPLETED)
    stop_waiter.cancel()
    failure: BaseException | None = None
    if not start.done():
        start.cancel()
        with contextlib.suppress(BaseException):
            await start
    elif start.exception() is not None:
        failure = start.exception()
    else:
        return True
    if failure is not None:
        print(f"engine: failed to start: {failure}", file=sys.stderr, flush=True)
    with contextlib.suppress(Exception):
        await models.close()
    remove_run_files()
    return False


async def _drain(state: ServerState, shutdown: _Shutdown) -> None:
    """Stop taking requests; give in-flight ones drain_timeout; abort what is left."""
    state.draining = True
    engines = [served.llm for _, served in state.models.loaded()]
    timeout = state.settings.server.drain_timeout
    drain = asyncio.create_task(_drain_all(engines, timeout))
    forced = asyncio.create_task(shutdown.forced.wait())
    await asyncio.wait({drain, forced}, return_when=asyncio.FIRST_COMPLETED)
    forced.cancel()
    if not drain.done():
        drain.cancel()
    with contextlib.suppress(BaseException):
        await drain
    for llm in engines:
        for row in llm.requests():
            with contextlib.suppress(Exception):
                await llm.abort(row.request_id)


async def _drain_all(engines: list[Any], timeout: float) -> None:
    await asyncio.gather(*(llm.drain(timeout) for llm in engines))


def _requests_in_flight(state: ServerState) -> list[Any]:
    return [row for _, served in state.models.loaded() for row in served.llm.requests()]


def _admin_socket_path(settings: Settings) -> tuple[Path, Path | None]:
    """The admin socket, and the per-run directory to remove at exit when we chose it."""
    if settings.admin.socket:
        return Path(settings.admin.socket).expanduser(), None
    path = prepare_default_socket(os.environ, os.getpid())
    return path, path.parent
