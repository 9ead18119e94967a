"""What the root reads from its rings, taken in: the detokenizer's outputs and the tokenizer's
prompt ids go to the gateway; the scheduler's reports are kept by the caller."""

from __future__ import annotations

from engine.inflight.registry import Gateway
from engine.messages.reports import SchedulerReport
from engine.messages.ring_catalogue import OUTPUTS_RING, PROMPTS_RING, REPORTS_RING, ring_of
from engine.runtime.supervision import Received


def take_in(gateway: Gateway, received: Received) -> SchedulerReport | None:
    """Apply one receipt of the root's rings to `gateway`; the latest scheduler report in it.

    Prompt ids go first: outputs read in the same receipt need not wait for them."""
    report = None
    for ring, frames in sorted(received, key=lambda item: ring_of(item[0]) is not PROMPTS_RING):
        entry = ring_of(ring)
        if entry is PROMPTS_RING:
            for prompt in PROMPTS_RING.decode_many(frames):
                gateway.learn_prompt(prompt)
        elif entry is OUTPUTS_RING:
            for batch in OUTPUTS_RING.decode_many(frames):
                gateway.deliver(batch)
        elif entry is REPORTS_RING:
            reports = REPORTS_RING.decode_many(frames)
            report = reports[-1] if reports else report
    return report
