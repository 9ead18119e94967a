"""Run `engine proxy`: bind, probe every instance once, serve, print one ready line, and on
SIGINT/SIGTERM stop taking connections and give in-flight ones `drain_timeout` to finish.

The ready line reads like `engine serve`'s (`engine ready: URL (...)`), so whatever waits for
one waits for the other the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Generator

import httpx
import uvicorn
import uvloop
from starlette.applications import Starlette

from engine.http.connections import KEEP_ALIVE_S, guarded_http_protocol
from engine.proxy.app import build_proxy_app
from engine.proxy.config import ProxyConfig
from engine.proxy.metrics import ProxyMetrics
from engine.proxy.pool import InstancePool
from engine.proxy.upstream import new_client, probe_all, probe_forever

log = logging.getLogger("engine.proxy")

HEADER_TIMEOUT_S = 10.0  # a client's request head must arrive within this (slowloris guard)
BODY_TIMEOUT_S = 60.0  # and its body within this after the head
MAX_CONNECTIONS = 4096


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (it re-raises the signal once it has stopped,
    which would end the process with the signal instead of 0)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def serve_proxy(config: ProxyConfig) -> int:
    logging.basicConfig(
        stream=sys.stderr,
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "httpx", "httpcore"):
        logging.getLogger(name).setLevel("WARNING")
    return uvloop.run(_serve(config))


def listen_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def _serve(config: ProxyConfig) -> int:
    try:
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        sock = socket.create_server((config.host, config.port), family=family, backlog=2048)
    except OSError as e:
        print(f"engine proxy: cannot listen on {config.host}:{config.port}: {e}", file=sys.stderr)
        return 1
    sock.setblocking(False)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    pool = InstancePool.of(config.prefill, config.decode, config.probe_failures)
    try:
        async with new_client(config) as client:
            # Instances not up yet are marked down here and taken in once they answer.
            await probe_all(pool, client, pool.instances, config.probe_timeout)
            app = build_proxy_app(pool, client, ProxyMetrics(pool), config)
            return await _run(app, sock, config, stop, pool, client)
    finally:
        sock.close()


async def _run(
    app: Starlette,
    sock: socket.socket,
    config: ProxyConfig,
    stop: asyncio.Event,
    pool: InstancePool,
    client: httpx.AsyncClient,
) -> int:
    server = _Server(
        uvicorn.Config(
            app,
            lifespan="off",
            log_config=None,
            access_log=config.log_level == "debug",
            timeout_graceful_shutdown=max(1, int(config.drain_timeout)),
            timeout_keep_alive=KEEP_ALIVE_S,
            http=guarded_http_protocol(
                HEADER_TIMEOUT_S, MAX_CONNECTIONS, body_timeout=BODY_TIMEOUT_S
            ),
            ws="none",
        )
    )
    serve_task = asyncio.create_task(server.serve(sockets=[sock]))
    prober = asyncio.create_task(
        probe_forever(pool, client, config.probe_interval, config.probe_timeout)
    )
    try:
        while not server.started and not serve_task.done():
            await asyncio.sleep(0.01)
        if serve_task.done():
            serve_task.result()  # raises what stopped uvicorn
        url = listen_url(config.host, sock.getsockname()[1])
        roles = f"prefill {', '.join(config.prefill)}; decode {', '.join(config.decode)}"
        print(f"engine ready: {url} (proxy; {roles})", flush=True)
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({serve_task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if serve_task.done():
            print("engine proxy: the HTTP server stopped unexpectedly", file=sys.stderr)
            return 1
        log.info("shutting down: letting in-flight requests finish")
        return 0
    finally:
        prober.cancel()
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serve_task, config.drain_timeout + 5.0)
