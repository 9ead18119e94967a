"""One typed encoder/decoder per channel.

A channel is the set of message types that may travel over one kind of ring. Decoders are typed
(`msgspec.msgpack.Decoder(Union[...])`), so a frame that is not one of the channel's messages is a
clear error, never code execution. A frame that fails to decode is logged with the channel's name
and counted; the caller keeps running.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T")

log = logging.getLogger(__name__)


class Channel(Generic[T]):
    """Encoder and decoder for the messages of one channel (`T` is a Struct or a Union of them)."""

    def __init__(self, name: str, message_type: Any) -> None:
        self.name = name
        self.message_type = message_type
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(message_type)
        self.decode_errors = 0

    def encode(self, message: T) -> bytes:
        return self._encoder.encode(message)

    def decode(self, frame: bytes | memoryview) -> T:
        """Decode one frame; raises msgspec.DecodeError / ValidationError on a bad frame."""
        return self._decoder.decode(frame)

    def decode_or_none(self, frame: bytes | memoryview) -> T | None:
        """Decode one frame; a bad frame is logged, counted and returned as None."""
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.decode_errors += 1
            log.error(
                "channel %s: dropped a malformed frame of %d bytes (%s); %d dropped so far",
                self.name,
                len(frame),
                exc,
                self.decode_errors,
            )
            return None

    def decode_many(self, frames: Iterable[bytes | memoryview]) -> list[T]:
        """Decode a drained batch, skipping (and counting) malformed frames."""
        out: list[T] = []
        for frame in frames:
            message = self.decode_or_none(frame)
            if message is not None:
                out.append(message)
        return out


class FrameTooLarge(ValueError):
    """A frame (or one item of a batch) that no frame of the allowed size can carry: raised by
    a ring for a frame larger than it could ever hold, and by encode_in_frames."""


def too_large_for_one_frame(size: int, max_bytes: int) -> str:
    """Why a request that would take a `size`-byte frame between actors is refused."""
    return (
        f"the request takes {size} bytes to pass between the engine's actors, more than they "
        f"carry in one message ({max_bytes}); shorten its prompt, stop strings or samples"
    )


def encode_in_frames(
    channel: Channel[T],
    build: Callable[..., T],
    parts: Sequence[list[Any]],
    max_bytes: int,
) -> list[bytes]:
    """Frames of at most `max_bytes` carrying every item of `parts` (the item lists of one
    batch message, `build(*parts)`): the whole batch if it fits, else contiguous runs of its
    items in order (so items of an earlier list always travel before those of a later one).
    FrameTooLarge names an item that does not fit alone."""
    items = [(kind, item) for kind, part in enumerate(parts) for item in part]

    def frames(start: int, stop: int) -> list[bytes]:
        grouped: list[list[Any]] = [[] for _ in parts]
        for kind, item in items[start:stop]:
            grouped[kind].append(item)
        frame = channel.encode(build(*grouped))
        if len(frame) <= max_bytes:
            return [frame]
        if stop - start <= 1:
            raise FrameTooLarge(
                f"channel {channel.name}: one item takes {len(frame)} bytes, more than a "
                f"frame may ({max_bytes})"
            )
        middle = (start + stop) // 2
        return frames(start, middle) + frames(middle, stop)

    return frames(0, len(items))
