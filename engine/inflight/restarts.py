"""What the root does with the supervisor's news (for AsyncLLM): count a crash against the
requests in flight at the actor, resubmit every unfinished request a restart concerned, hand a
failed replica's requests to the others, and fail everything once the supervisor gives up."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from engine.actors.roles import Role, holds_requests
from engine.inflight.crashes import drain_restarts, is_crash
from engine.inflight.registry import Gateway, ToTokenizer
from engine.inflight.replicas import Replicas
from engine.runtime.events import ChildDied, ChildRestarted, Escalated, ReplicaFailed

log = logging.getLogger("engine")


class SupervisorFollower:
    def __init__(
        self,
        gateway: Gateway,
        replicas: Replicas,
        role_of: Callable[[str], str],
        submit: Callable[[list[ToTokenizer]], Awaitable[None]],
        escalated: Callable[[str], None],
    ) -> None:
        self.gateway = gateway
        self.replicas = replicas
        self.role_of = role_of  # an actor's role by its name
        self.submit = submit
        self.escalated = escalated  # the supervisor gave up, with this reason

    async def follow(self, events: asyncio.Queue[Any]) -> None:
        while True:
            event = await events.get()
            if isinstance(event, ChildDied):
                log.warning("actor %s died (%s); restarting it", event.name, event.reason)
                if is_crash(event) and self._holds_requests(event.name):
                    tokenizer = self.role_of(event.name) == Role.TOKENIZER
                    self.gateway.record_crash(event.name, event.reason, tokenizer=tokenizer)
            elif isinstance(event, ChildRestarted):
                await self._restarted([event.name, *drain_restarts(events)], event.reason)
            elif isinstance(event, ReplicaFailed):
                submissions = self.gateway.resubmit_all(
                    self.replicas.requests_of_failed(event.replica)
                )
                log.warning(
                    "replica %d gave up (%s): resubmitting its %d unfinished request(s) to the "
                    "others",
                    event.replica,
                    event.reason,
                    len(submissions),
                )
                if submissions:
                    await self.submit(submissions)
            elif isinstance(event, Escalated):
                self.escalated(event.reason)

    async def _restarted(self, restarted: list[str], reason: str) -> None:
        # Every actor is on the request path: whatever was in flight through it is gone (for a
        # tokenizer, only what it had not passed on yet). A group restart reports each member:
        # resubmit once for all of them.
        if not any(self._holds_requests(name) for name in restarted):
            return
        # With replicas, only those of the restarted actors: the others run on.
        only = self.replicas.requests_concerned(restarted)
        if all(self.role_of(name) == Role.TOKENIZER for name in restarted):
            lost = self.gateway.lost_with_tokenizer()
            only = lost if only is None else only & lost
        submissions = self.gateway.resubmit_all(only)
        log.warning(
            "%s restarted (%s): resubmitting %d unfinished request(s)",
            ", ".join(restarted),
            reason,
            len(submissions),
        )
        if submissions:
            await self.submit(submissions)

    def _holds_requests(self, name: str) -> bool:
        return holds_requests(self.role_of(name))
