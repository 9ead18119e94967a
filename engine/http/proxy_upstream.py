"""Calls from the proxy to instances over httpx, each one bounded by the configured timeouts.

An instance *fails* a call when it cannot be reached, times out, answers 5xx, or breaks its
answer off before the end: `InstanceFailed`, which the caller turns into marking it down. A 4xx
is an answer like any other (the client's request was at fault) and is relayed.

A streamed answer (text/event-stream) is opened and its first chunk read before anything is
sent to the client, so a decode instance that fails before its first byte can be replaced; any
other answer is read whole first for the same reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from engine.http.proxy_config import ProxyConfig
from engine.http.proxy_pool import Instance, InstancePool

log = logging.getLogger("engine.proxy")

# Response headers an instance's answer keeps through the proxy (content-length is recomputed).
RELAYED_HEADERS = ("content-type", "x-request-id", "retry-after", "www-authenticate")
EVENT_STREAM = "text/event-stream"


class InstanceFailed(Exception):
    pass


@dataclass
class Answer:
    """A whole answer, read before the client sees any of it."""

    status: int
    headers: dict[str, str]
    body: bytes


@dataclass
class OpenStream:
    """A streamed answer whose first chunk has arrived; the rest is read as it is relayed."""

    status: int
    headers: dict[str, str]
    first_chunk: bytes
    rest: AsyncIterator[bytes]
    response: httpx.Response

    async def close(self) -> None:
        await self.response.aclose()


def new_client(config: ProxyConfig) -> httpx.AsyncClient:
    timeout = httpx.Timeout(
        connect=config.connect_timeout,
        read=config.read_timeout,
        write=config.read_timeout,
        pool=config.connect_timeout,
    )
    # Streams hold a connection each for their whole life: allow many (httpx's default is 100).
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    return httpx.AsyncClient(timeout=timeout, limits=limits, follow_redirects=False)


def _relayed(response: httpx.Response) -> dict[str, str]:
    return {k: v for k in RELAYED_HEADERS if (v := response.headers.get(k)) is not None}


def _why(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


async def open_answer(
    client: httpx.AsyncClient,
    instance: Instance,
    method: str,
    path: str,
    body: bytes,
    headers: dict[str, str],
) -> Answer | OpenStream:
    """Send a request to `instance`; its answer read whole, or opened if it is a 2xx stream."""
    request = client.build_request(method, instance.url + path, content=body, headers=headers)
    try:
        response = await client.send(request, stream=True)
    except httpx.HTTPError as e:
        raise InstanceFailed(_why(e)) from e
    try:
        streamed = EVENT_STREAM in response.headers.get("content-type", "")
        if response.is_success and streamed:
            rest = response.aiter_raw()
            first = await anext(rest, b"")
            return OpenStream(response.status_code, _relayed(response), first, rest, response)
        answer = Answer(response.status_code, _relayed(response), await response.aread())
    except httpx.HTTPError as e:
        await response.aclose()
        raise InstanceFailed(_why(e)) from e
    except BaseException:
        await response.aclose()
        raise
    await response.aclose()
    if answer.status >= 500:
        raise InstanceFailed(f"answered {answer.status}: {answer.body[:200]!r}")
    return answer


async def relay_rest(stream: OpenStream) -> AsyncIterator[bytes]:
    """The stream's chunks after the first; InstanceFailed if it breaks before its end."""
    try:
        async for chunk in stream.rest:
            yield chunk
    except httpx.HTTPError as e:
        raise InstanceFailed(_why(e)) from e


async def probe(client: httpx.AsyncClient, instance: Instance, timeout: float) -> str | None:
    """None if the instance can take requests now, else why not. Our instances answer /ready
    (503 while draining or restarting an actor, when /health still says 200: taken back then,
    a draining instance would fail every request sent to it); others, /health."""
    try:
        response = await client.get(instance.url + "/ready", timeout=timeout)
        if response.status_code == 404:
            response = await client.get(instance.url + "/health", timeout=timeout)
    except httpx.HTTPError as e:
        return _why(e)
    if response.status_code == 200:
        return None
    return f"{response.url.path} answered {response.status_code}"


async def probe_all(
    pool: InstancePool, client: httpx.AsyncClient, instances: list[Instance], timeout: float
) -> None:
    """Probe `instances` at once; mark each up or down by its answer."""
    verdicts = await asyncio.gather(*(probe(client, i, timeout) for i in instances))
    for instance, why in zip(instances, verdicts, strict=True):
        if why is None:
            if not instance.up:
                log.info("%s instance %s is up again", instance.role.value, instance.url)
            pool.mark_up(instance)
        elif pool.mark_down(instance, why):
            log.warning("%s instance %s is down: %s", instance.role.value, instance.url, why)


async def probe_down_forever(
    pool: InstancePool, client: httpx.AsyncClient, interval: float, timeout: float
) -> None:
    """Every `interval` seconds, probe the instances that are down (a failed request marked
    them); those ready again are chosen again."""
    while True:
        await asyncio.sleep(interval)
        down = pool.down()
        if not down:
            continue
        try:
            await probe_all(pool, client, down, timeout)
        except Exception:  # a bug here must not stop instances from ever coming back
            log.exception("probing down instances failed")
