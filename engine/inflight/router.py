"""The data-parallel router: which replica serves each request (root process, plain logic).

A new request goes to the live replica with the fewest pending tokens; every later message about
it (a resubmission after a restart, an abort) goes where it went, so a replica never runs two
epochs of one request side by side with another replica.

Pending tokens of a request = its prompt while no token has come back (the prefill is still
ahead) + what its unfinished samples may still generate (max_tokens, else up to max_model_len,
less what they delivered). A replica's load is the sum over the requests assigned to it, read
from the gateway's records, so each request is counted once, with its current progress: a
resubmission adds nothing (its request is already in the sum), a finished request drops out.
The sum is cached between output batches (`invalidate`), and a request routed meanwhile is
added to the cached sum once; the next recount includes it from the records instead.

A prompt given as text is counted at about four characters per token until the tokenizer's
count comes back with the first output batch; which replica is least loaded does not depend on
the new request's own size, only on the others'.

The router reads the frames the root has just encoded as RoutingViews: their prompt ids, chat
and resume points are never decoded (a prompt's length is read off its array's header).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import msgspec

from engine.inflight.records import RequestRecord
from engine.inflight.registry import Gateway
from engine.messages.requests import ROUTING, RoutingView
from engine.messages.ring_catalogue import REQUESTS_RING

CHARS_PER_TOKEN = 4  # a rough count for text not yet tokenized


def prompt_tokens(request: RequestRecord | RoutingView) -> int:
    """The prompt's token count, estimated from its text until the tokenizer's is known."""
    if isinstance(request, RoutingView):
        count, messages = request.num_prompt_token_ids(), None
        if count is None:
            messages = request.chat_messages()
    else:
        ids, messages = request.prompt_token_ids, request.request.messages
        count = None if ids is None else len(ids)
    if count is not None:
        return count
    text = request.request.prompt or ""
    if messages is not None:
        text = "".join(message.content for message in messages)
    return len(text) // CHARS_PER_TOKEN + 1


def pending_tokens(record: RequestRecord, max_model_len: int) -> int:
    """Tokens a replica still has to compute for this request (see the module doc)."""
    prompt = prompt_tokens(record)
    budget = _output_budget(record.params.max_tokens, prompt, max_model_len)
    outputs = sum(
        max(budget - len(sample.token_ids), 0) for sample in record.samples if not sample.finished
    )
    return outputs + (prompt if record.first_token_at is None else 0)


def submitted_tokens(request: RoutingView, max_model_len: int) -> int:
    """Pending tokens of a request as it is submitted (nothing of it computed yet)."""
    prompt = prompt_tokens(request)
    params = request.request.params
    budget = _output_budget(params.max_tokens, prompt, max_model_len)
    return prompt + budget * params.n


def _has_output(request: RoutingView) -> bool:
    """Some sample of it already has tokens (a resubmission past its first token)."""
    return any(sample.delivered_token_ids for sample in request.resumed_samples() or [])


def _output_budget(max_tokens: int | None, prompt: int, max_model_len: int) -> int:
    return max(max_model_len - prompt, 0) if max_tokens is None else max_tokens


class LeastPendingRouter:
    def __init__(
        self,
        num_replicas: int,
        gateway: Gateway,
        max_model_len: int,
        roles: Sequence[str] | None = None,
    ) -> None:
        """`roles`: each replica's P/D role ("prefill" | "decode" | "both"); None: all both."""
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.num_replicas = num_replicas
        self.roles = list(roles) if roles is not None else ["both"] * num_replicas
        if len(self.roles) != num_replicas:
            raise ValueError(f"{len(self.roles)} roles for {num_replicas} replicas")
        self.disaggregated = any(role != "both" for role in self.roles)
        self.gateway = gateway
        self.max_model_len = max_model_len
        self.replica_of: dict[str, int] = {}
        self.live = list(range(num_replicas))
        self.routed = [0] * num_replicas  # new requests sent to each replica, since start
        self._loads: list[int] | None = None  # cached sums; None: recount at next use
        self._requests = [0] * num_replicas  # unfinished requests per replica, as of the count

    # ---- load ----------------------------------------------------------------------------------

    def loads(self) -> list[int]:
        """Pending tokens per replica (cached until `invalidate`)."""
        if self._loads is None:
            self._loads = self._count()
        return list(self._loads)

    def requests(self) -> list[int]:
        """Unfinished requests per replica (as of the last count, plus those routed since)."""
        self.loads()
        return list(self._requests)

    def invalidate(self) -> None:
        """Progress was made (outputs arrived): recount at the next decision."""
        self._loads = None

    def _count(self) -> list[int]:
        loads = [0] * self.num_replicas
        self._requests = [0] * self.num_replicas
        for record in self.gateway.records():
            replica = self.replica_of.get(record.request_id)
            # A held request runs nowhere until the gateway releases it.
            if replica is not None and not record.held:
                loads[replica] += pending_tokens(record, self.max_model_len)
                self._requests[replica] += 1
        # Requests that finished, failed or were aborted since: forget where they ran.
        for request_id in [rid for rid in self.replica_of if rid not in self.gateway]:
            del self.replica_of[request_id]
        return loads

    # ---- decisions -----------------------------------------------------------------------------

    def choose(self, request: RoutingView) -> int:
        """The replica for `request`: where it already is, else the least loaded live one (of
        the role its stage needs, with P/D: see `candidates`)."""
        candidates = self.candidates(request)
        replica = self.replica_of.get(request.request_id)
        if replica is not None and replica in candidates:
            return replica  # already counted in that replica's load
        if replica is not None:  # it moves (P/D: prefilled, on to a decode replica)
            del self.replica_of[request.request_id]
            self.invalidate()  # recount without it where it was
        loads = self.loads()
        # Ties (an idle engine, a burst of equal requests) go to the replica with fewer
        # requests, then to the first.
        replica = min(candidates, key=lambda r: (loads[r], self._requests[r], r))
        self.replica_of[request.request_id] = replica
        self.routed[replica] += 1
        assert self._loads is not None  # loads() filled it
        self._loads[replica] += submitted_tokens(request, self.max_model_len)
        self._requests[replica] += 1
        return replica

    def candidates(self, request: RoutingView) -> list[int]:
        """Live replicas that may serve `request` now. With P/D, a request that has no token
        yet goes to a prefill replica, one that has (or whose KV was handed off) to a decode
        replica; when no replica of that role is left, any live one serves it colocated."""
        if not self.disaggregated:
            return self.live
        has_source = request.request.kv_source is not None
        role = "decode" if has_source or _has_output(request) else "prefill"
        return [r for r in self.live if self.roles[r] == role] or self.live

    def route(self, frames: Sequence[bytes]) -> dict[int, list[bytes]]:
        """Gateway -> tokenizer frames, split by the replica each must go to."""
        out: dict[int, list[bytes]] = {}
        for frame in frames:
            message = ROUTING.decode(frame)
            if isinstance(message, RoutingView):
                chosen = self.choose(message)
                if self.disaggregated:
                    frame = self._with_kv_directives(message, chosen, frame)
                out.setdefault(chosen, []).append(frame)
                continue
            by_replica: dict[int, list[str]] = {}
            for request_id in message.request_ids:
                replica = self.replica_of.get(request_id)
                # Never routed: it never reached a replica, any live one may hear the abort.
                targets = [replica] if replica is not None else self.live[:1]
                for target in targets:
                    by_replica.setdefault(target, []).append(request_id)
            for replica, ids in by_replica.items():
                abort = type(message)(ids)
                out.setdefault(replica, []).append(REQUESTS_RING.encode(abort))
        return out

    def _with_kv_directives(self, request: RoutingView, replica: int, frame: bytes) -> bytes:
        """P/D: a prefill replica hands a request of one sample on after its first token (while a
        decode replica is left to take it); a KV source is only for a decode replica (on a
        prefill replica serving colocated, the held blocks are in its own prefix cache)."""
        routed = request.request
        hands_on = (
            self.roles[replica] == "prefill"
            and routed.params.n == 1
            and any(self.roles[r] == "decode" for r in self.live)
        )
        handoff = "continue" if hands_on else ""
        source = routed.kv_source if self.roles[replica] == "decode" else None
        if handoff == routed.kv_handoff and source is routed.kv_source:
            return frame
        changed = msgspec.structs.replace(routed, kv_handoff=handoff, kv_source=source)
        # the same GenerateRequest, but for these two fields
        return ROUTING.encode(msgspec.structs.replace(request, request=changed))

    def requests_on(self, replicas: Collection[int]) -> set[str]:
        """Unfinished requests routed to any of `replicas`, and those routed nowhere now (a dead
        replica's, waiting to be routed afresh)."""
        return {
            record.request_id
            for record in self.gateway.records()
            if self.replica_of.get(record.request_id, -1) in replicas
            or record.request_id not in self.replica_of
        }

    def mark_dead(self, replica: int) -> list[str]:
        """`replica` serves no more; its requests are routed afresh when resubmitted. Returns
        their ids."""
        if replica in self.live:
            self.live.remove(replica)
        moved = [rid for rid, r in self.replica_of.items() if r == replica]
        for request_id in moved:
            del self.replica_of[request_id]
        self.invalidate()
        return moved
