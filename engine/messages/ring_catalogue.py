"""Every ring between the engine's parties, declared once: name, writer, readers, the channel
(message types) it carries, and capacity.

The plan (engine/launch/plan.py, engine/launch/pd_plan.py) declares a replica's rings from
these entries, with the names of the children that hold the roles; actors send through them
(`Actor.send_to`) and decode what they receive by the entry of the ring it came on (`ring_of`).
The root's own control and status rings of each child are the runtime's, not listed here.

    requests         root -> tokenizer           GenerateRequest, AbortRequests
    submit           tokenizer -> scheduler      SubmitRequest, AbortRequests, RequestFailed
    prompts          tokenizer -> root           PromptTokens (the ids of a text prompt)
    plan             scheduler -> worker ranks   StepPlan (broadcast)
    results          worker rank 0 -> scheduler  StepResult, WorkerFailed
    tokens           scheduler -> detokenizer    TokenBatch, TextStart, failures, aborts
    stops            detokenizer -> scheduler    StopSamples, AbortRequests
    outputs          detokenizer -> root         OutputBatch
    reports          scheduler -> root           SchedulerReport
    rendezvous       worker rank 0 -> ranks > 0  Rendezvous (one host, no fixed master port)
    kv-orders        scheduler -> kv_transfers   HoldBlocks, DropHolds, PullBlocks (P/D)
    kv-events<rank>  kv_transfer -> scheduler    TransferEndpoint, BlocksReleased, ... (P/D)
"""

from __future__ import annotations

from typing import Any

from engine.messages.kv_transfer import KV_EVENTS, KV_ORDERS
from engine.messages.outputs import DETOKENIZER_TO_GATEWAY
from engine.messages.parallel import RENDEZVOUS
from engine.messages.reports import SCHEDULER_REPORTS
from engine.messages.requests import GATEWAY_TO_TOKENIZER, TOKENIZER_TO_GATEWAY
from engine.messages.rings import Ring
from engine.messages.roles import ROOT, Role
from engine.messages.scheduling import SCHEDULER_OUTPUTS, SCHEDULER_REQUESTS
from engine.messages.steps import STEP_PLANS, STEP_RESULTS

RING_BYTES = 8 * 2**20  # a ring holds several whole steps of a large batch
KV_RING_BYTES = 1 << 20  # orders and events are small; a pull names its blocks once

TOKENIZER, SCHEDULER, WORKER = Role.TOKENIZER, Role.SCHEDULER, Role.WORKER
DETOKENIZER, KV_TRANSFER = Role.DETOKENIZER, Role.KV_TRANSFER

REQUESTS_RING = Ring("requests", GATEWAY_TO_TOKENIZER, ROOT, (TOKENIZER,), RING_BYTES)
SUBMIT_RING = Ring("submit", SCHEDULER_REQUESTS, TOKENIZER, (SCHEDULER,), RING_BYTES)
PROMPTS_RING = Ring("prompts", TOKENIZER_TO_GATEWAY, TOKENIZER, (ROOT,), RING_BYTES)
PLAN_RING = Ring("plan", STEP_PLANS, SCHEDULER, (WORKER,), RING_BYTES)
RESULTS_RING = Ring("results", STEP_RESULTS, WORKER, (SCHEDULER,), RING_BYTES)
TOKENS_RING = Ring("tokens", SCHEDULER_OUTPUTS, SCHEDULER, (DETOKENIZER,), RING_BYTES)
STOPS_RING = Ring("stops", SCHEDULER_REQUESTS, DETOKENIZER, (SCHEDULER,), RING_BYTES)
OUTPUTS_RING = Ring("outputs", DETOKENIZER_TO_GATEWAY, DETOKENIZER, (ROOT,), RING_BYTES)
REPORTS_RING = Ring("reports", SCHEDULER_REPORTS, SCHEDULER, (ROOT,), RING_BYTES)
RENDEZVOUS_RING = Ring("rendezvous", RENDEZVOUS, WORKER, (WORKER,), RING_BYTES)
KV_ORDERS_RING = Ring("kv-orders", KV_ORDERS, SCHEDULER, (KV_TRANSFER,), KV_RING_BYTES)
KV_EVENTS_RING = Ring(
    "kv-events", KV_EVENTS, KV_TRANSFER, (SCHEDULER,), KV_RING_BYTES, per_rank=True
)

CATALOGUE: tuple[Ring[Any], ...] = (
    REQUESTS_RING,
    SUBMIT_RING,
    PROMPTS_RING,
    PLAN_RING,
    RESULTS_RING,
    TOKENS_RING,
    STOPS_RING,
    OUTPUTS_RING,
    REPORTS_RING,
    RENDEZVOUS_RING,
    KV_ORDERS_RING,
    KV_EVENTS_RING,
)


def ring_of(name: str) -> Ring[Any]:
    """The catalogue's entry of the ring named `name` (a per-rank ring's family entry)."""
    for ring in CATALOGUE:
        if ring.names(name):
            return ring
    known = ", ".join(repr(ring) for ring in CATALOGUE)
    raise KeyError(f"no ring {name!r} in the catalogue; its rings: {known}")


def read_by(role: str) -> tuple[Ring[Any], ...]:
    """The rings a party of this role reads."""
    return tuple(ring for ring in CATALOGUE if role in ring.readers)
