"""The detokenizer actor: the scheduler's token batches in, text deltas out to the gateway.

The domain work (incremental, multi-byte safe text; stop strings; re-priming after a restart)
is engine.text.Detokenizer. Samples ended by a stop string, and requests that failed here, are
reported to the scheduler on STOPS_RING so it stops generating them. Never imports torch, and
usually not transformers either (see hf_tokenizer).
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.actors.configs import DetokenizerConfig
from engine.messages.codec import encode_in_frames
from engine.messages.outputs import OutputBatch
from engine.messages.ring_catalogue import OUTPUTS_RING, STOPS_RING, TOKENS_RING
from engine.messages.roles import Role
from engine.messages.scheduling import SCHEDULER_OUTPUTS, AbortRequests, ToScheduler
from engine.runtime.actor import Actor
from engine.text import Detokenizer
from engine.text.hf_tokenizer import load_token_decoder


class DetokenizerActor(Actor):
    channels = (SCHEDULER_OUTPUTS,)
    role = Role.DETOKENIZER

    async def on_start(self) -> dict[str, Any] | None:
        config = msgspec.msgpack.decode(self.config, type=DetokenizerConfig)
        self.detokenizer = Detokenizer(load_token_decoder(config.model_path))
        return None

    async def handle(self, ring: str, frames: list[bytes]) -> None:
        output = self.detokenizer.handle(TOKENS_RING.decode_many(frames))  # its one inbound ring
        to_scheduler: list[ToScheduler] = list(output.stops)
        if output.aborts:  # requests that failed here: the scheduler stops generating them
            to_scheduler.append(AbortRequests(list(output.aborts)))
        if to_scheduler:
            await self.send_all(STOPS_RING, to_scheduler)
        batch = output.batch
        if batch is not None:  # split across frames when a step's outputs outgrow one
            max_bytes = self.rings.writer(OUTPUTS_RING.name).spec.max_frame_bytes
            parts: list[list[Any]] = [batch.started, batch.samples, batch.failures]
            frames = encode_in_frames(OUTPUTS_RING.channel, OutputBatch, parts, max_bytes)
            await self.send_many(OUTPUTS_RING, frames)
