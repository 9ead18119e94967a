"""Calls from the proxy to instances over httpx, each bounded by its own timeouts.

An instance *fails* a call when it cannot be reached (`Fault.REFUSED`: nothing listens there,
down at once), or leaves it unanswered: no first byte within the first-byte timeout, a
connection that breaks, or a stream idle past the read timeout (`Fault.STRIKE`: counted like a
failed probe). A call waiting on an instance that is marked down meanwhile (by the probes) ends
at once (`Fault.WENT_DOWN`) so that it can move elsewhere. An answer, whatever its status (5xx
included), is not a failure: whether the instance is up is for probes and connections to say.

A streamed answer (text/event-stream) is opened and its first chunk read before anything is
sent to the client, so a decode instance that fails before its first byte can be replaced; any
other answer is read whole first for the same reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

import httpx

from engine.proxy.config import ProxyConfig
from engine.proxy.pool import Instance, InstancePool

log = logging.getLogger("engine.proxy")

# Response headers an instance's answer keeps through the proxy (content-length is recomputed).
RELAYED_HEADERS = ("content-type", "x-request-id", "retry-after", "www-authenticate")
EVENT_STREAM = "text/event-stream"

T = TypeVar("T")


class Fault(StrEnum):
    REFUSED = "refused"  # no connection: down at once
    STRIKE = "strike"  # timed out or broke off: one failure, like a failed probe
    WENT_DOWN = "went_down"  # marked down (by probes) while this call waited on it


class InstanceFailed(Exception):
    def __init__(self, why: str, fault: Fault) -> None:
        super().__init__(why)
        self.fault = fault


class AnswerTimedOut(Exception):
    """A whole (non-streamed) answer took longer than the read timeout, its instance up all
    along: a long generation, the client's to hear about (504), no failure of the instance."""


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
    # Only the connection's own phases are httpx's to time; how long an answer may take (first
    # byte, whole answer, idle stream) is set per call below, where a probe can cut it short.
    timeout = httpx.Timeout(
        connect=config.connect_timeout, read=None, write=None, pool=config.connect_timeout
    )
    # Streams hold a connection each for their whole life: allow many (httpx's default is 100).
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    return httpx.AsyncClient(timeout=timeout, limits=limits, follow_redirects=False)


def _relayed(response: httpx.Response) -> dict[str, str]:
    return {k: v for k in RELAYED_HEADERS if (v := response.headers.get(k)) is not None}


def _why(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _fault(error: httpx.HTTPError) -> InstanceFailed:
    if isinstance(error, httpx.ConnectError):  # refused, unreachable: nothing to wait for
        return InstanceFailed(_why(error), Fault.REFUSED)
    return InstanceFailed(_why(error), Fault.STRIKE)


async def _unless_down(
    pool: InstancePool, instance: Instance, seconds: float, call: Callable[[], Awaitable[T]]
) -> T:
    """`call()`'s result; TimeoutError past `seconds`, InstanceFailed(WENT_DOWN) as soon as
    `instance` is marked down (the call is cancelled either way)."""
    went_down = False
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(seconds) as deadline:

            def expire_now() -> None:
                nonlocal went_down
                went_down = True
                deadline.reschedule(loop.time())

            with pool.watch_down(instance, expire_now):
                return await call()
    except TimeoutError:
        if went_down:
            why = f"marked down while waiting: {instance.last_error}"
            raise InstanceFailed(why, Fault.WENT_DOWN) from None
        raise


async def open_answer(
    client: httpx.AsyncClient,
    pool: InstancePool,
    instance: Instance,
    method: str,
    path: str,
    body: bytes,
    headers: dict[str, str],
    *,
    within: float,
    first_byte: bool,
) -> Answer | OpenStream:
    """Send a request to `instance`; its answer read whole, or opened if it is a 2xx stream.
    `within` seconds bound the first byte (`first_byte`: a stream's first event, a prefill's
    one token; past it the instance failed) or the whole answer (past it: AnswerTimedOut)."""
    request = client.build_request(method, instance.url + path, content=body, headers=headers)

    async def answer() -> Answer | OpenStream:
        try:
            response = await client.send(request, stream=True)
        except httpx.HTTPError as e:
            raise _fault(e) from e
        try:
            streamed = EVENT_STREAM in response.headers.get("content-type", "")
            if response.is_success and streamed:
                rest = response.aiter_raw()
                first = await anext(rest, b"")
                return OpenStream(response.status_code, _relayed(response), first, rest, response)
            whole = Answer(response.status_code, _relayed(response), await response.aread())
        except httpx.HTTPError as e:
            await response.aclose()
            raise InstanceFailed(_why(e), Fault.STRIKE) from e
        except BaseException:
            await response.aclose()
            raise
        await response.aclose()
        return whole

    try:
        return await _unless_down(pool, instance, within, answer)
    except TimeoutError:
        if first_byte:
            raise InstanceFailed(f"no first byte within {within:g} s", Fault.STRIKE) from None
        raise AnswerTimedOut(f"{instance.url} did not answer within {within:g} s") from None


async def relay_rest(
    pool: InstancePool, instance: Instance, stream: OpenStream, idle: float
) -> AsyncIterator[bytes]:
    """The stream's chunks after the first; InstanceFailed if it breaks before its end, stays
    idle `idle` seconds, or its instance is marked down."""
    cuts = instance.cuts  # changes if it was marked down (and cut) while a chunk was relayed
    while True:
        if instance.cuts != cuts:
            why = f"marked down while streaming: {instance.last_error}"
            raise InstanceFailed(why, Fault.WENT_DOWN)
        try:
            chunk = await _unless_down(pool, instance, idle, lambda: anext(stream.rest))
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise InstanceFailed(f"no chunk for {idle:g} s", Fault.STRIKE) from None
        except httpx.HTTPError as e:
            raise InstanceFailed(_why(e), Fault.STRIKE) from e
        yield chunk


@dataclass(frozen=True)
class Verdict:
    """A probe's finding: `why` the instance cannot take requests now (None: it can), and
    whether it answered at all. An instance that answers 503 is alive (draining, or restarting
    an actor): it finishes what it has, so only new requests must go elsewhere."""

    why: str | None
    answered: bool = True


async def probe(client: httpx.AsyncClient, instance: Instance, timeout: float) -> Verdict:
    """Whether the instance can take requests now. Our instances answer /ready (503 while
    draining or restarting an actor, when /health still says 200: taken back then, a draining
    instance would fail every request sent to it); others, /health."""
    try:
        async with asyncio.timeout(timeout):
            response = await client.get(instance.url + "/ready", timeout=timeout)
            if response.status_code == 404:
                response = await client.get(instance.url + "/health", timeout=timeout)
    except TimeoutError:
        return Verdict(f"no answer to a probe within {timeout:g} s", answered=False)
    except httpx.HTTPError as e:
        return Verdict(_why(e), answered=False)
    if response.status_code == 200:
        return Verdict(None)
    return Verdict(f"{response.url.path} answered {response.status_code}")


def judge(pool: InstancePool, instance: Instance, verdict: Verdict, *, at_once: bool) -> None:
    """Mark `instance` by a probe's verdict: up at the first good one (a down instance is
    always probed: half-open), down at once (`at_once`) or after `pool.down_after` in a row.
    Requests waiting on it are cut (to move elsewhere) only if it did not answer: one that
    answers finishes them, whatever happens to the actors inside it."""
    why = verdict.why
    if why is None:
        if not instance.up:
            log.info("%s instance %s is up again", instance.role.value, instance.url)
        pool.mark_up(instance)
        return
    cut = not verdict.answered
    instance.answering = verdict.answered
    if at_once:
        went = pool.mark_down(instance, why, cut_waiting=cut)
    else:
        went = pool.strike(instance, why, cut_waiting=cut)
    if went:
        log.warning("%s instance %s is down: %s", instance.role.value, instance.url, why)


async def probe_all(
    pool: InstancePool, client: httpx.AsyncClient, instances: list[Instance], timeout: float
) -> None:
    """Probe `instances` at once; mark each up or down by its answer (the check at start: an
    instance not ready yet is down until it is)."""
    verdicts = await asyncio.gather(*(probe(client, i, timeout) for i in instances))
    for instance, verdict in zip(instances, verdicts, strict=True):
        judge(pool, instance, verdict, at_once=True)


async def probe_forever(
    pool: InstancePool, client: httpx.AsyncClient, interval: float, timeout: float
) -> None:
    """Probe every instance, up or down, every `interval` seconds (each on its own clock, so
    one that hangs delays no other): `pool.down_after` failures in a row take it out of
    rotation, one success brings it back."""
    await asyncio.gather(*(_probe_one(pool, client, i, interval, timeout) for i in pool.instances))


async def _probe_one(
    pool: InstancePool,
    client: httpx.AsyncClient,
    instance: Instance,
    interval: float,
    timeout: float,
) -> None:
    loop = asyncio.get_running_loop()
    wait = interval
    while True:
        await asyncio.sleep(wait)
        started = loop.time()
        try:
            judge(pool, instance, await probe(client, instance, timeout), at_once=False)
        except Exception:  # a bug here must not stop instances from ever coming back
            log.exception("probing %s failed", instance.url)
        wait = max(0.0, interval - (loop.time() - started))
