"""The P/D proxy's Starlette app: an OpenAI-compatible front over prefill and decode instances.

A completion or chat completion is prefilled on a prefill instance (one token, its KV kept for
a decode instance) and then sent, as the client wrote it plus the prefill's transfer
parameters, to a decode instance whose answer (status, content type, body; streams chunk by
chunk) is the client's. Every other route goes to a decode instance; /health, /ready,
/health/instances and /metrics are the proxy's own. With an API key set, every route but
/health, /ready and /metrics requires it (the instances check the key they are given too).

Whether an instance is up is for probes (upstream.probe_forever) and connections to say:
a refused connection takes it down at once, a missed first byte or an idle stream counts like a
failed probe. After such a failure (upstream.InstanceFailed) the request moves on: to
another prefill instance, else to a decode instance without KV (it prefills itself); to another
decode instance while nothing has reached the client; once a stream has begun, its end is an
SSE error event. An answer is never a failure: a 5xx is sent once to another instance of the
role if there is one and then relayed (a prefill's: the decode instance prefills instead), a
4xx is the client's answer, relayed as it came; neither marks anything down.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import httpx
import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine.http.streams import ReleasingStream
from engine.proxy.client_side import (
    body_or_refusal,
    unauthorized,
    unless_client_leaves,
    upstream_headers,
)
from engine.proxy.config import ProxyConfig
from engine.proxy.metrics import ProxyMetrics
from engine.proxy.pd import (
    decode_body,
    error_body,
    json_object,
    kv_transfer_params_of,
    prefill_body,
    stream_error_event,
)
from engine.proxy.pool import Instance, InstancePool, NoInstanceUp, Role
from engine.proxy.upstream import (
    Answer,
    AnswerTimedOut,
    Fault,
    InstanceFailed,
    OpenStream,
    open_answer,
    relay_rest,
)

log = logging.getLogger("engine.proxy")

JSON = "application/json"
ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


class ProxyRoutes:
    def __init__(
        self,
        pool: InstancePool,
        client: httpx.AsyncClient,
        metrics: ProxyMetrics,
        config: ProxyConfig,
    ) -> None:
        self.pool = pool
        self.client = client
        self.metrics = metrics
        self.config = config
        self._falling_back = False  # no prefill instance was up at the last request

    # -- routes -----------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._served("completions", request, self._disaggregated)

    async def chat_completions(self, request: Request) -> Response:
        return await self._served("chat_completions", request, self._disaggregated)

    async def forward(self, request: Request) -> Response:
        async def to_decode(request: Request, body: bytes) -> Response:
            return await self._decode(request, body, upstream_headers(request), streamed=False)

        return await self._served("other", request, to_decode)

    async def abort(self, request: Request) -> Response:
        async def everywhere(request: Request, body: bytes) -> Response:
            return await self._abort_everywhere(body, upstream_headers(request))

        return await self._served("abort", request, everywhere)

    async def health(self, request: Request) -> Response:
        """200 while at least one instance of each role is up; else 503 naming the role(s). Open
        to anyone, so it says no more than that: which instances there are and why one is down
        is /health/instances', behind the API key."""
        missing = [role for role in Role if not self.pool.any_up(role)]
        if missing:
            message = "; ".join(f"no {role.value} instance is up" for role in missing)
            return Response(error_body(message, 503), 503, media_type=JSON)
        return Response(_json({"status": "ok"}), media_type=JSON)

    async def instances(self, request: Request) -> Response:
        """/health's status with every instance: "up", or since when it is down and its last
        error (a 503's message names them all, as a request's 503 does)."""
        if (refused := unauthorized(request, self.config.api_key)) is not None:
            return refused
        state = {
            role.value: {
                i.url: "up" if i.up else i.describe().removeprefix(f"{i.url} ")
                for i in self.pool.of_role(role)
            }
            for role in Role
        }
        missing = [role for role in Role if not self.pool.any_up(role)]
        if missing:
            message = "; ".join(str(NoInstanceUp(r, self.pool.of_role(r))) for r in missing)
            error = msgspec.json.decode(error_body(message, 503))
            return Response(
                _json({"status": "unavailable", **error, **state}), 503, media_type=JSON
            )
        return Response(_json({"status": "ok", **state}), media_type=JSON)

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    # -- the P/D path -----------------------------------------------------------------------

    async def _disaggregated(self, request: Request, body: bytes) -> Response:
        headers = upstream_headers(request)
        fields = json_object(body)
        if fields is None:  # not a JSON object: the decode instance answers what is wrong
            return await self._decode(request, body, headers, streamed=False)
        prefilled = await self._prefill(request.url.path, fields, headers)
        if isinstance(prefilled, Response):
            return prefilled
        streamed = fields.get("stream") is True
        return await self._decode(
            request, decode_body(fields, prefilled), headers, streamed=streamed
        )

    async def _prefill(
        self, path: str, fields: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any] | Response | None:
        """The prefill's transfer parameters (None: the decode instance prefills), or the
        prefill instance's 4xx answer for the client. A 5xx is sent once to another prefill
        instance, then to the decode instance (which answers the client)."""
        body = prefill_body(fields)
        tried: list[Instance] = []
        answered_5xx = False
        while True:
            try:
                instance = self.pool.choose(Role.PREFILL, exclude=tried)
            except NoInstanceUp as e:
                if answered_5xx:  # up, but erring: the decode instance prefills and answers
                    self.metrics.prefill_fallbacks.inc()
                    return None
                if not self._falling_back:  # once per outage, not once per request
                    log.warning("prefilling on decode instances until one is back: %s", e)
                self._falling_back = True
                self.metrics.prefill_fallbacks.inc()
                return None
            if tried:
                self.metrics.retries.labels(Role.PREFILL.value).inc()
            tried.append(instance)
            instance.outstanding += 1
            try:
                answer = await self._open(instance, "POST", path, body, headers, first_byte=True)
            except InstanceFailed as e:
                self._failed(instance, e)
                continue
            finally:
                instance.outstanding -= 1
            if isinstance(answer, OpenStream):  # asked stream: false; a stream is not an answer
                await answer.close()
                log.warning("prefill instance %s answered with a stream", instance.url)
                continue
            self._falling_back = False
            if answer.status >= 500:
                self.metrics.upstream_5xx.labels(Role.PREFILL.value).inc()
                if answered_5xx:
                    self.metrics.prefill_fallbacks.inc()
                    return None
                answered_5xx = True
                continue
            if answer.status >= 400:
                return _relay(answer)
            try:
                params = kv_transfer_params_of(answer.body)
            except ValueError as e:
                log.warning("prefill instance %s: %s; decoding without", instance.url, e)
                params = None
            if params is None:
                self.metrics.without_kv.inc()
            return params

    async def _decode(
        self, request: Request, body: bytes, headers: dict[str, str], *, streamed: bool
    ) -> Response:
        """The decode instance's answer. A stream must begin within the first-byte timeout; a
        whole answer may take the read timeout (a long generation), while its instance is up."""
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        own = {"x-request-id": headers["x-request-id"]}
        tried: list[Instance] = []
        answered_5xx: Answer | None = None  # the first, sent once elsewhere before it is relayed
        while True:
            try:
                instance = self.pool.choose(Role.DECODE, exclude=tried)
            except NoInstanceUp as e:
                if answered_5xx is not None:
                    return _relay(answered_5xx)
                return Response(error_body(str(e), 503), 503, own, media_type=JSON)
            if tried:
                self.metrics.retries.labels(Role.DECODE.value).inc()
            tried.append(instance)
            instance.outstanding += 1
            try:
                answer = await self._open(
                    instance, request.method, path, body, headers, first_byte=streamed
                )
            except InstanceFailed as e:
                instance.outstanding -= 1
                self._failed(instance, e)
                continue
            except AnswerTimedOut as e:
                instance.outstanding -= 1
                return Response(error_body(str(e), 504), 504, own, media_type=JSON)
            except BaseException:
                instance.outstanding -= 1
                raise
            if isinstance(answer, Answer):
                instance.outstanding -= 1
                if answer.status >= 500:
                    self.metrics.upstream_5xx.labels(Role.DECODE.value).inc()
                    if answered_5xx is None:
                        answered_5xx = answer
                        continue
                return _relay(answer)
            chunks = self._relay_stream(instance, answer)
            release = functools.partial(_release, instance, answer)
            return ReleasingStream(
                chunks, release, status_code=answer.status, headers=answer.headers
            )

    async def _relay_stream(
        self, instance: Instance, stream: OpenStream
    ) -> AsyncGenerator[bytes, None]:
        """The decode instance's chunks as they come. Tokens already sent cannot be taken back,
        so a stream that breaks ends with an error event instead of moving elsewhere."""
        last = stream.first_chunk
        try:
            yield stream.first_chunk
            async for chunk in relay_rest(self.pool, instance, stream, self.config.read_timeout):
                last = chunk
                yield chunk
        except InstanceFailed as e:
            self._failed(instance, e)
            self.metrics.broken_streams.inc()
            # The break may have cut an event in half: end that one before the error event.
            separator = b"" if not last or last.endswith(b"\n\n") else b"\n\n"
            message = f"decode instance {instance.url} failed mid-stream: {e}"
            yield separator + stream_error_event(message)

    async def _abort_everywhere(self, body: bytes, headers: dict[str, str]) -> Response:
        """POST /abort to every instance up (the request is on its prefill or its decode
        instance, which the client cannot name): a 200 from any is the answer, else the first
        answer (a 404: in flight nowhere). An abort that arrives while the request is being
        prefilled ends the prefill only: its decode is still sent."""
        targets = list({i.url: i for i in self.pool.instances if i.up}.values())
        if not targets:
            return Response(error_body("no instance is up", 503), 503, media_type=JSON)
        results = await asyncio.gather(
            *(self._open(i, "POST", "/abort", body, headers, first_byte=True) for i in targets),
            return_exceptions=True,
        )
        answers: list[Answer] = []
        for instance, result in zip(targets, results, strict=True):
            if isinstance(result, Answer):
                answers.append(result)
            elif isinstance(result, OpenStream):
                await result.close()
            elif isinstance(result, InstanceFailed):
                self._failed(instance, result)
            elif isinstance(result, BaseException):
                raise result
        if not answers:
            return Response(error_body("no instance answered the abort", 503), 503, media_type=JSON)
        best = min(answers, key=lambda a: (a.status != 200, a.status >= 500))
        return _relay(best)

    # -- helpers ----------------------------------------------------------------------------

    async def _open(
        self,
        instance: Instance,
        method: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        *,
        first_byte: bool,
    ) -> Answer | OpenStream:
        config = self.config
        within = config.first_byte_timeout if first_byte else config.read_timeout
        return await open_answer(
            self.client,
            self.pool,
            instance,
            method,
            path,
            body,
            headers,
            within=within,
            first_byte=first_byte,
        )

    def _failed(self, instance: Instance, failed: InstanceFailed) -> None:
        """A refused connection takes `instance` down; a timeout or a broken connection counts
        like a failed probe; one marked down meanwhile is down already."""
        why = str(failed)
        if failed.fault is Fault.REFUSED:
            went = self.pool.mark_down(instance, why)
        elif failed.fault is Fault.STRIKE:
            went = self.pool.strike(instance, why)
        else:
            return
        if went:
            log.warning("%s instance %s is down: %s", instance.role.value, instance.url, why)

    async def _served(
        self, route: str, request: Request, work: Callable[[Request, bytes], Awaitable[Response]]
    ) -> Response:
        """`work` on the request's body, counted by route and status. A client that hangs up
        before the answer is ready cancels the work, which closes its upstream requests, so the
        instances abort them instead of computing an answer for nobody."""
        response = unauthorized(request, self.config.api_key)
        if response is None:
            body = await body_or_refusal(request, self.config.max_request_bytes)
            if isinstance(body, Response):
                response = body
            else:
                response = await unless_client_leaves(request, work(request, body))
        self.metrics.requests.labels(route, str(response.status_code)).inc()
        return response


def build_proxy_app(
    pool: InstancePool, client: httpx.AsyncClient, metrics: ProxyMetrics, config: ProxyConfig
) -> Starlette:
    routes = ProxyRoutes(pool, client, metrics, config)
    return Starlette(
        routes=[
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
            Route("/health", routes.health, methods=["GET"]),
            Route("/health/instances", routes.instances, methods=["GET"]),
            Route("/ready", routes.health, methods=["GET"]),
            Route("/metrics", routes.metrics_text, methods=["GET"]),
            Route("/abort", routes.abort, methods=["POST"]),
            Route("/{path:path}", routes.forward, methods=ALL_METHODS),
        ]
    )


async def _release(instance: Instance, stream: OpenStream) -> None:
    instance.outstanding -= 1
    await stream.close()


def _relay(answer: Answer) -> Response:
    return Response(answer.body, answer.status, headers=answer.headers)


def _json(value: Any) -> bytes:
    return msgspec.json.encode(value)
