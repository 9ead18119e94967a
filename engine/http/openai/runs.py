"""One API request's life on the engine: open its engine requests, relay their outputs, and
abort whatever is left when the client goes away or something fails.

A batched completions request (several prompts) becomes one engine request per prompt; their
outputs are merged in arrival order. Engine refusals (prompt too long, queue full) arrive before
the first output, so they surface here as `ApiError`s before any byte of a response is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Protocol, TypeVar

import msgspec

from engine.http.openai.bodies import SSE_DONE, ChoiceState, ResponseBuilder, sse_event
from engine.http.openai.errors import (
    INTERNAL_ERROR_MESSAGE,
    ApiError,
    api_error_from,
    outcome_of,
)
from engine.http.openai.finished import log_request, observe_finished
from engine.http.openai.parsing import OpenAIRequest
from engine.http.openai.recording import RequestRecording
from engine.messages.scheduling import FirstScheduled
from engine.request.outputs import EngineError, RequestOutput
from engine.tenants.access import run_as, scoped_id
from engine.tenants.quotas import QuotaLease
from engine.tenants.table import EVERYONE, Tenant

if TYPE_CHECKING:
    from engine.http.served import ModelLease, ServedModel
    from engine.http.state import ServerState

log = logging.getLogger("engine.requests")

# Detached abort tasks live here until done (the event loop keeps only weak references).
_BACKGROUND: set[asyncio.Task[None]] = set()


T = TypeVar("T")


class Shaper(Protocol[T]):
    """What a streamed response makes of a run's outputs (RequestRun.relay)."""

    def opening(self) -> list[T]: ...
    def shape(self, prompt_index: int, out: RequestOutput) -> list[T]: ...
    def closing(self) -> list[T]: ...  # once every output came, before the run is counted
    def failed(self, error: ApiError) -> T: ...
    def ending(self) -> list[T]: ...  # last, however it ended, after the run was counted


class EventStream:
    """Chat and completions SSE events (bodies.py shapes them), ending with [DONE]."""

    def __init__(self, builder: ResponseBuilder) -> None:
        self.builder = builder

    def opening(self) -> list[bytes]:
        return self.builder.opening_events()

    def shape(self, prompt_index: int, out: RequestOutput) -> list[bytes]:
        return self.builder.delta_events(prompt_index, out)

    def closing(self) -> list[bytes]:
        return [self.builder.usage_event()] if self.builder.api.include_usage else []

    def failed(self, error: ApiError) -> bytes:
        return sse_event(error.encoded())

    def ending(self) -> list[bytes]:
        return [SSE_DONE]


class RequestRun:
    def __init__(
        self,
        state: ServerState,
        api: OpenAIRequest,
        endpoint: str,
        recording: RequestRecording | None = None,
        *,
        tenant: Tenant = EVERYONE,
    ) -> None:
        self.state = state
        self.tenant = tenant
        self.api = api
        self.endpoint = endpoint
        server = state.settings.server
        self.builder = ResponseBuilder(api, server.tool_call_parser, server.reasoning_parser)
        self.arrival = time.monotonic()
        self._streams: list[AsyncIterator[RequestOutput]] = []
        self._finished: set[int] = set()
        self.first_token_at: float | None = None
        self._last_token_at: dict[int, float] = {}
        self.scheduling: dict[int, FirstScheduled] = {}  # per prompt, once reported
        self.client_key = api.client_request_id or api.request_id  # X-Request-Id, /abort
        self.key = scoped_id(tenant, self.client_key)  # in state.runs: the tenant's own
        self._quota: QuotaLease | None = None
        self.trace_headers: dict[str, str] | None = None  # W3C trace context its spans continue
        state.runs[self.key] = self
        # The model it runs on: leased (loaded if need be) when it opens, released at its end.
        self.metrics = state.metrics.for_model(state.base_of(api.model))
        self.keep_alive: float | None = None  # the request's own; None: the model's default
        self._lease: ModelLease | None = None
        self.outcome = "aborted"
        self.status = 200  # the HTTP status answered; an engine refusal's otherwise
        self._counted = False
        self.recording = recording  # what it adds to the trace, when one is recorded

    # ------------------------------------------------------------ opening

    async def open(self) -> list[tuple[int, RequestOutput]]:
        """Submit every prompt and wait for each one's first output (or its refusal)."""
        p = self.api
        self._admit()
        served = await self._lease_model()
        lora = served.adapter_of(p.model)
        for request in p.requests:
            request.trace_headers = self.trace_headers
            if lora is not None:
                request.params = msgspec.structs.replace(request.params, lora_request=lora)
            self._streams.append(aiter(served.llm.submit(request)))
        results = await asyncio.gather(
            *(anext(stream) for stream in self._streams), return_exceptions=True
        )
        firsts: list[tuple[int, RequestOutput]] = []
        failure: BaseException | None = None
        for i, result in enumerate(results):
            if isinstance(result, RequestOutput):
                firsts.append((i, result))
                if result.finished:
                    self._finished.add(i)
            else:
                self._finished.add(i)  # refused or ended: nothing to abort for this prompt
                failure = failure or result
        if failure is not None:
            self.abort_unfinished()
            status = failure.status if isinstance(failure, EngineError) else 500
            self.status = status
            self.outcome = outcome_of(status)
            self.finish()
            if isinstance(failure, EngineError):
                raise api_error_from(failure)
            if isinstance(failure, StopAsyncIteration):
                raise ApiError(500, "the engine ended the request without any output")
            raise failure
        if p.echo:
            for i, first in firsts:
                text = p.requests[i].prompt
                assert served.tokens is not None
                echoed = await served.tokens.echo(text, first.prompt_token_ids)
                self.builder.echoed[i] = echoed
        return firsts

    def _admit(self) -> None:
        """Run as its tenant (its model, priority and salt allowed) within its quotas: a
        refusal (404, 403, 400, 429 with Retry-After) ends the run before anything runs."""
        p = self.api
        try:
            run_as(self.tenant, p.requests, p.model, p.priority, p.cache_salt)
            self._quota = self.state.tenants.quotas.admit(self.tenant.name, p.most_tokens)
        except EngineError as e:
            self.status, self.outcome = e.status, outcome_of(e.status)
            self.finish()
            raise api_error_from(e) from None

    async def _lease_model(self) -> ServedModel:
        """The request's model, loaded if need be: its loading is part of the wait for the
        first token. A model that cannot be had is the request's refusal."""
        try:
            self._lease = await self.state.acquire(self.api.model, self.keep_alive)
        except EngineError as e:
            self.status, self.outcome = e.status, outcome_of(e.status)
            self.finish()
            raise api_error_from(e) from None
        return self._lease.engine

    # ------------------------------------------------------------ relaying

    async def outputs(
        self, firsts: list[tuple[int, RequestOutput]]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every output of every prompt, first ones included, with metrics observed."""
        for item in firsts:
            self._observe(*item)
            yield item
        pending = [i for i in range(len(self._streams)) if i not in self._finished]
        if len(pending) == 1:
            (i,) = pending
            async for out in self._streams[i]:
                self._observe(i, out)
                yield i, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()
        pumps = [asyncio.create_task(self._pump(i, queue)) for i in pending]
        try:
            remaining = len(pumps)
            while remaining:
                i, got = await queue.get()
                if got is None:
                    remaining -= 1
                elif isinstance(got, BaseException):
                    raise got
                else:
                    self._observe(i, got)
                    yield i, got
        finally:
            for pump in pumps:
                pump.cancel()

    async def _pump(
        self, i: int, queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]]
    ) -> None:
        try:
            async for out in self._streams[i]:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        queue.put_nowait((i, None))

    def _observe(self, i: int, out: RequestOutput) -> None:
        now = time.monotonic()
        metrics = self.metrics
        model = metrics.model_name
        if out.scheduling is not None:
            self.scheduling.setdefault(i, out.scheduling)
        for delta in out.outputs:
            count = len(delta.token_ids)
            if count == 0:
                continue
            metrics.add_generation_tokens(count)
            if self.first_token_at is None:
                self.first_token_at = now
                metrics.ttft.labels(model).observe(now - self.arrival)
            key = i * self.api.n + delta.index
            if self.recording is not None:
                self.recording.tokens_delivered(key, delta.token_ids, now - self.arrival)
            last = self._last_token_at.get(key)
            if last is not None:
                per_token = (now - last) / count
                itl = metrics.itl.labels(model)
                for _ in range(count):
                    itl.observe(per_token)
            self._last_token_at[key] = now
        if out.finished:
            self._finished.add(i)

    # ------------------------------------------------------------ the two response shapes

    async def run_to_end(self) -> None:
        """Run to the end, every output absorbed by the builder."""
        firsts = await self.open()
        try:
            async for i, out in self.outputs(firsts):
                self.builder.absorb(i, out)
        except EngineError as e:
            self.outcome = "error"
            raise api_error_from(e) from None
        finally:
            # Before abort_unfinished, which counts what it aborts as finished: a client that
            # left before the end (this coroutine cancelled) leaves the outcome "aborted".
            ran_to_end = len(self._finished) == len(self._streams)
            self.abort_unfinished()
            if self.outcome == "aborted" and ran_to_end:
                self.outcome = self._ended_outcome()
            self.finish()

    async def collect(self) -> bytes:
        """Run to the end and return the one-shot JSON body."""
        await self.run_to_end()
        return self.builder.final_body()

    async def release(self) -> None:
        """However the response ended (to its end, broken, or the client gone before its first
        byte): abort what still runs, count the request, free its id. Idempotent."""
        self.abort_unfinished()
        self.finish()

    def sse(self, firsts: list[tuple[int, RequestOutput]]) -> AsyncGenerator[bytes, None]:
        """The chat or completions event stream, ending with [DONE]."""
        return self.relay(firsts, EventStream(self.builder))

    async def relay(
        self, firsts: list[tuple[int, RequestOutput]], shaper: Shaper[T]
    ) -> AsyncGenerator[T, None]:
        """The outputs as `shaper` shapes them; a client that goes away cancels it here and its
        requests abort. However it fails, it ends with the shaper's failure and its ending: an
        exception let out would make uvicorn cut the connection mid-body, which a client reads
        as a broken transfer."""
        try:
            for item in shaper.opening():
                yield item
            async for i, out in self.outputs(firsts):
                for item in shaper.shape(i, out):
                    yield item
            for item in shaper.closing():
                yield item
            self.outcome = self._ended_outcome()
        except EngineError as e:
            self.outcome = "error"
            yield shaper.failed(api_error_from(e))
        except Exception:
            log.exception("request %s: its %s stream failed", self.key, self.endpoint)
            self.outcome = "error"
            yield shaper.failed(ApiError(500, INTERNAL_ERROR_MESSAGE))
        finally:
            self.abort_unfinished()
            self.finish()
        for item in shaper.ending():
            yield item

    # ------------------------------------------------------------ ending

    @property
    def choices(self) -> list[ChoiceState]:
        return self.builder.choices

    def _ended_outcome(self) -> str:
        """A request that ran to its end; aborted (admin, drain) if any sample was cut off."""
        reasons = {c.finish_reason for c in self.builder.choices}
        return "aborted" if "abort" in reasons else "success"

    def abort_unfinished(self) -> None:
        """Abort engine requests still running. Detached: this runs inside cancellations."""
        for i, stream in enumerate(self._streams):
            if i in self._finished:
                continue
            self._finished.add(i)
            task = asyncio.get_running_loop().create_task(
                self._abort(self.api.requests[i].request_id or "", stream)
            )
            _BACKGROUND.add(task)
            task.add_done_callback(_BACKGROUND.discard)

    async def _abort(self, engine_request_id: str, stream: AsyncIterator[RequestOutput]) -> None:
        lease = self._lease
        if lease is not None:
            with contextlib.suppress(Exception):
                await lease.engine.llm.abort(engine_request_id)
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()

    def finish(self) -> None:
        """Count the request once, by outcome, and record it in the trace when asked."""
        if self._counted:
            return
        self._counted = True
        if self.state.runs.get(self.key) is self:
            del self.state.runs[self.key]
        now = time.monotonic()
        metrics = self.metrics
        metrics.count_request(self.endpoint, self.outcome)
        usage = self.builder.usage()
        metrics.add_prompt_tokens(usage.prompt_tokens)
        if self.status == 200:
            observe_finished(metrics, self, now, usage)
        server = self.state.settings.server
        if server.enable_log_requests:
            log_request(self, now, usage, server.max_log_len)
        if self._lease is not None:
            self._lease.release()
        if self._quota is not None:  # charged what it cost: tokens never generated come back
            self._quota.settle(usage.prompt_tokens + usage.completion_tokens)
        if self.recording is not None and self.state.trace is not None:
            first = self.first_token_at
            self.state.trace.submit(
                self.recording.record(
                    self.api,
                    self.builder.choices if self.status == 200 else [],  # refused: none
                    outcome=self.outcome,
                    status=self.status,
                    prompt_tokens=usage.prompt_tokens,
                    completion_tokens=usage.completion_tokens,
                    ttft=None if first is None else first - self.arrival,
                    e2e=now - self.arrival,
                )
            )
