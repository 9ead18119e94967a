"""AsyncLLM: the engine for asyncio applications; it owns the actor system of one model.

It lives in the root process: it starts the supervisor, keeps the gateway (every unfinished
request's truth), pumps the detokenizer's output (and the tokenizer's prompt ids) into
per-request streams, and after any restart on the request path resubmits every unfinished
request under a new epoch (engine/inflight/; with data-parallel replicas, every unfinished
request of the restarted actor's replica). A death that was a crash (not a kill from outside)
is counted against the requests in flight at the actor, which the gateway retries alone and
quarantines if they crash it again (see gateway). Past the restart intensity every request
fails with 503 and `health()` says why.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from engine.inflight.inbound import take_in
from engine.inflight.kv_params import KvParams, instance_kv_params
from engine.inflight.registry import Gateway, ToTokenizer
from engine.inflight.replicas import Replicas, supervise
from engine.inflight.restarts import SupervisorFollower
from engine.launch.footprint import planned_memory_bytes
from engine.launch.model_source import model_directory
from engine.launch.plan import EnginePlan, plan_engine
from engine.launch.run_files import remove_run_files
from engine.library.admission import admit
from engine.lora.registry import AdapterRegistry, start_registry
from engine.messages.admin import ActorRow, EngineStats, Health, RequestRow
from engine.messages.codec import too_large_for_one_frame
from engine.messages.params import SamplingParams
from engine.messages.reports import SchedulerReport
from engine.messages.requests import EngineRequest, GenerateRequest
from engine.messages.ring_catalogue import REQUESTS_RING
from engine.request.outputs import EngineError, RequestOutput, merge_outputs, snapshot
from engine.request.policy import RequestPolicy
from engine.request.prompts import Prompt, library_request
from engine.runtime.events import actor_cpu, actor_rows, ring_traffic
from engine.runtime.ring import RingClosed
from engine.runtime.shm_space import require_shm_space
from engine.runtime.supervision import Supervision
from engine.settings import Settings, resolve_home
from engine.telemetry.tracer import open_request_tracer

log = logging.getLogger("engine")
SHM_REMEDY = ("lower cache.kv_cache_memory (each CPU rank's KV cache is a segment there)",)
MAX_FRAME_BYTES = REQUESTS_RING.max_frame_bytes  # the most the root sends the tokenizer at once


class AsyncLLM:
    def __init__(
        self,
        settings: Settings | None = None,
        *,
        memory_room: int | None = None,
        owns_run_files: bool = True,
    ) -> None:
        """`memory_room`: the bytes its weights and KV cache may take (the KV cache is sized
        from it; None: from the machine's free memory); `owns_run_files`: whether its shutdown
        removes the run's restart files (not where other models of the run keep theirs)."""
        self.settings = settings or Settings()
        self._memory_room = memory_room
        self._owns_run_files = owns_run_files
        server = self.settings.server
        self.gateway = Gateway(
            self.settings.runtime.quarantine_after,
            stream_buffer=server.stream_buffer,
            stalled_stream_timeout=server.stalled_stream_timeout,
            seed=self.settings.model.seed,
        )
        self.model_name = ""
        self.model_path = ""  # the checkpoint directory, once started
        # Every request's defaults and limits (engine/request/), the model's once started.
        self.policy = RequestPolicy()
        self.max_model_len = 0
        self.weight_bytes: dict[str, int] = {}  # per rank, by format (EnginePlan.weight_bytes)
        self._plan: EnginePlan | None = None
        self.adapters: AdapterRegistry | None = None  # LoRA adapters by name; None: LoRA off
        self._kv_params = KvParams("both")  # start() reads this instance's
        self._supervisor: Supervision | None = None
        self._replicas: Replicas | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._sends: set[asyncio.Task[None]] = set()  # owed submissions on their way
        self._report: SchedulerReport | None = None
        self._failure: str | None = None  # why the engine can no longer serve
        self._closing: asyncio.Task[None] | None = None  # a shutdown a root task's death began
        self._closed = False

    # ---- life cycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        model = self.settings.model
        # A GGUF file's first start derives its config and tokenizer: off the event loop too.
        model_path, default_name = await asyncio.to_thread(
            model_directory, model.path, resolve_home(self.settings), model.tokenizer
        )
        self.model_path = model_path
        self._kv_params = instance_kv_params(self.settings)  # reads the KV secret, if it needs one
        # Off the event loop: other models of the server serve on while this one is planned.
        self._plan = await asyncio.to_thread(
            plan_engine, self.settings, model_path, self._memory_room
        )
        self.policy = RequestPolicy.load(self.settings, model_path, self._plan.max_model_len)
        require_shm_space(self._plan.replica_specs, remedy=SHM_REMEDY)  # not a SIGBUS later
        # One-launch P/D: a prefill replica's handoff goes on to a decode replica here.
        self.gateway.hands_on_locally = "decode" in self._plan.replica_roles and (
            "prefill" in self._plan.replica_roles
        )
        # As vLLM: the name clients use is the --model value as given, unless one is set.
        served = model.served_name or (default_name,)
        self.model_name = served[0]
        self.adapters = start_registry(
            self.settings.lora, self._plan.model_config, served, resolve_home(self.settings)
        )
        # --otlp-traces-endpoint: each request's span, made as it leaves the gateway
        tracer = open_request_tracer(self.settings.server.otlp_traces_endpoint, self.model_name)
        self.gateway.on_request_end = tracer.record if tracer is not None else None

        self.max_model_len = self._plan.max_model_len
        self.weight_bytes = self._plan.weight_bytes
        self._supervisor, self._replicas = supervise(
            self._plan.replica_specs,
            self.gateway,
            self._plan.max_model_len,
            self._plan.replica_roles,
        )
        events = self._supervisor.subscribe()
        await self._supervisor.start()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._pump_outputs(), name="gateway-outputs"),
            loop.create_task(self._follow_supervisor(events), name="gateway-events"),
        ]
        for task in self._tasks:
            task.add_done_callback(self._on_root_task_done)

    def _on_root_task_done(self, task: asyncio.Task[None]) -> None:
        """These tasks carry every output and every restart: one that ends while the engine
        runs would leave each stream hanging. It is escalated like a supervisor giving up."""
        if self._closed or task.cancelled():
            return
        error = task.exception()
        if error is None and self._failure is not None:
            return  # the output pump ends when an escalation closed the rings: not news
        what = f"{error!r}" if error is not None else "it returned"
        reason = f"the engine's {task.get_name()} task died ({what})"
        log.error("%s; shutting down", reason, exc_info=error)
        self._failure = reason
        self.gateway.fail_all(EngineError(f"the engine failed: {reason}", 503))
        # Held here, not in _sends: shutdown cancels those, and must not cancel itself.
        self._closing = asyncio.get_running_loop().create_task(self.shutdown(reason))

    async def shutdown(self, reason: str = "shutdown requested") -> None:
        if self._closed:
            return
        self._closed = True
        self.gateway.fail_all(EngineError(f"the engine is shutting down: {reason}", 503))
        for task in [*self._tasks, *self._sends]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._sends, return_exceptions=True)
        if self._supervisor is not None:
            await self._supervisor.shutdown(reason)
        if self._owns_run_files:
            remove_run_files()

    async def wait_closed(self) -> str:
        """Wait until the actor system has shut down (asked to, or given up); the reason."""
        if self._supervisor is None:
            raise RuntimeError("the engine has not been started")
        return await self._supervisor.wait_closed()

    async def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for in-flight requests to finish; True if they did."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self.gateway) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return not len(self.gateway)

    async def __aenter__(self) -> AsyncLLM:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    # ---- requests ------------------------------------------------------------------------------

    async def stream(
        self, prompt: Prompt | None = None, params: SamplingParams | None = None, **options: Any
    ) -> AsyncIterator[RequestOutput]:
        """Incremental outputs: each holds the new text / tokens of the samples that advanced.

        `prompt`: text, token ids, {"prompt": text} or {"prompt_token_ids": ids}; or chat
        `messages`, rendered with `chat_template`, else model.chat_template, else the model's
        own (given `chat_template_kwargs`, `add_generation_prompt`); without `params`, the
        model's generation defaults. `request_id`; `kv_transfer_params`: P/D across instances
        (inflight/kv_params.py); `trace_headers`: the W3C trace context its span continues;
        `lora_request`: vLLM's LoRARequest (None: the base model). See library_request."""
        async for output in self.submit(library_request(prompt, params, **options)):
            yield output

    async def submit(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Run one request, as a front end built it; incremental outputs as for `stream`.

        The request is the engine's from then on: admitted in place (admission.py: the
        model's defaults, the chat template, every limit: EngineError naming the field), and
        the registry keeps it as the request's truth until it ends."""
        self._check_running()
        waiting = self._waiting_samples()
        await admit(request, self.policy, self._kv_params, self.adapters, waiting)
        record, submission = self.gateway.register(request)
        finished = False
        try:
            if submission is not None:  # None: held back while a suspect is on probation
                await self._submit([submission])
            while not finished:
                item = await record.stream.get()
                finished = isinstance(item, EngineError) or item.finished
                yield self._delivered(item)
        finally:
            if not finished:  # the consumer went away (client disconnect, cancel): abort
                await self.abort(record.request_id)

    def _delivered(self, item: RequestOutput | EngineError) -> RequestOutput:
        """An output as the caller gets it; an error is raised."""
        if isinstance(item, EngineError):
            raise item
        if item.kv_transfer_params is not None:  # a prefill instance's word: signed
            item.kv_transfer_params = self._kv_params.signed(item.kv_transfer_params)
        return item

    async def complete(
        self,
        prompt: Prompt | None = None,
        params: SamplingParams | None = None,
        **options: Any,
    ) -> RequestOutput:
        """The whole result of one request (`options` as for `stream`)."""
        return await self.complete_request(library_request(prompt, params, **options))

    async def complete_request(self, request: EngineRequest) -> RequestOutput:
        """The whole result of one request, as `submit` runs it."""
        final: RequestOutput | None = None
        async for delta in self.submit(request):
            final = merge_outputs(final, delta)
        assert final is not None
        final.outputs.sort(key=lambda output: output.index)
        return final

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        **options: Any,
    ) -> AsyncIterator[RequestOutput]:
        """As vLLM's AsyncLLM.generate: each output holds everything generated so far (the
        last one has finished=True). `stream` gives only what is new in each."""
        total: RequestOutput | None = None
        async for delta in self.stream(prompt, sampling_params, request_id=request_id, **options):
            total = merge_outputs(total, delta)
            yield snapshot(total)

    async def abort(self, request_id: str) -> bool:
        abort = self.gateway.abort(request_id)
        if abort is None:
            return False
        await self._send([REQUESTS_RING.encode(abort)])
        self._send_owed()
        return True

    @property
    def chat_template(self) -> str | None:
        """model.chat_template's text, for chats that bring no template of their own."""
        return self.policy.chat_template

    # ---- what the admin socket, /health and /metrics show --------------------------------------

    def health(self) -> Health:
        rows = self._supervisor.status() if self._supervisor is not None else []
        not_ready = [row.name for row in rows if row.state != "running"]
        ready = bool(rows) and not not_ready and self._failure is None
        return Health(ready=ready, not_ready=not_ready, reason=self._failure)

    def stats(self) -> EngineStats:
        report = self._report
        figures = msgspec.structs.asdict(report.stats) if report is not None else {}
        rows = self._supervisor.status() if self._supervisor is not None else []
        return EngineStats(
            **figures,
            in_flight=len(self.gateway),
            resubmitted_requests=self.gateway.resubmissions,
            stalled_stream_aborts=self.gateway.stalled_aborts,
            restarts={row.name: row.restarts for row in rows},
            actor_recovery_seconds={row.name: row.recovery_seconds for row in rows},
            kv_cache_blocks=self._plan.num_blocks if self._plan else 0,
            replicas=self._replicas.replica_stats(report) if self._replicas else [],
            ring_traffic=ring_traffic(rows),
            actor_cpu=actor_cpu(rows),
        )

    def memory_bytes(self) -> int:
        """What its weights and KV caches take on this host, every rank of every replica."""
        return planned_memory_bytes(self._plan) if self._plan is not None else 0

    def actors(self) -> list[ActorRow]:
        return actor_rows(self._supervisor.status() if self._supervisor is not None else [])

    def requests(self) -> list[RequestRow]:
        rows = self.gateway.describe()
        if self._replicas is not None:
            for row in rows:
                row.replica = self._replicas.replica_of(row.request_id)
        return rows

    def set_log_level(self, level: str) -> None:
        """Every actor's log level (the root's own is the caller's to set)."""
        if self._supervisor is not None:
            self._supervisor.set_log_level(level.upper())

    # ---- internals -----------------------------------------------------------------------------

    def _check_running(self) -> None:
        if self._failure is not None:
            raise EngineError(f"the engine cannot serve: {self._failure}", 503)
        if self._supervisor is None or self._closed:
            raise EngineError("the engine is not running", 503)

    def _waiting_samples(self) -> int:
        """Samples of the requests that have no first token yet (the queue's limit counts them)."""
        return sum(r.params.n for r in self.gateway.records() if r.first_token_at is None)

    async def _submit(self, submissions: list[ToTokenizer]) -> None:
        frames = []
        for submission in submissions:
            frame = REQUESTS_RING.encode(submission)
            if len(frame) > MAX_FRAME_BYTES and isinstance(submission, GenerateRequest):
                # e.g. a resubmission carrying many samples' delivered tokens: it fails alone
                error = EngineError(too_large_for_one_frame(len(frame), MAX_FRAME_BYTES), 400)
                self.gateway.fail(submission.request_id, error)
                continue
            frames.append(frame)
        await self._send(frames)

    async def _send(self, frames: list[bytes]) -> None:
        assert self._supervisor is not None
        # False means the tokenizer restarted while we waited: the resubmission that follows
        # every restart carries these requests again.
        await self._supervisor.root.send_many(REQUESTS_RING.name, frames)

    def _send_owed(self) -> None:
        """Send what the gateway owes (probation moved on) without holding up the caller."""
        owed = self.gateway.take_submissions()
        if owed:
            task = asyncio.get_running_loop().create_task(self._submit(owed))
            self._sends.add(task)
            task.add_done_callback(self._sends.discard)

    async def _pump_outputs(self) -> None:
        assert self._supervisor is not None
        root = self._supervisor.root
        while True:
            try:
                received = await root.recv()
            except RingClosed:
                if self._failure is not None or self._closed:
                    return  # the supervisor shut down (escalation) and closed the root's rings
                raise
            self._report = take_in(self.gateway, received) or self._report
            self._send_owed()

    async def _follow_supervisor(self, events: asyncio.Queue[Any]) -> None:
        assert self._replicas is not None
        follower = SupervisorFollower(
            self.gateway, self._replicas, self._role, self._submit, self._escalated
        )
        await follower.follow(events)

    def _escalated(self, reason: str) -> None:
        self._failure = reason
        self.gateway.fail_all(EngineError(f"the engine failed: {reason}", 503))

    def _role(self, name: str) -> str:
        rows = self._supervisor.status() if self._supervisor is not None else []
        return next((row.role for row in rows if row.name == name), "")
