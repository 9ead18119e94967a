"""Channels into and out of the scheduler: requests in (from the tokenizer), tokens out (to the
detokenizer).

Inbound, `SubmitRequest` carries a tokenized request; after a failure the gateway resubmits it
with a newer `epoch`, listing in `resume` the samples still unfinished and the tokens already
delivered for each, and the scheduler replaces whatever it held for older epochs.

Outbound, the scheduler sends the detokenizer a `TextStart` for each request it took in, and
passes `AbortRequests` on, ahead of any tokens for them (one ring, so order holds). A TextStart
is what the detokenizer needs and no more: the last few prompt tokens (the first output tokens
decode in their context), the text parameters, the delivered tokens to prime itself with; the
whole prompt only when prompt logprobs are asked for (they are named by its tokens). The gateway
learns the ids of a text prompt from the tokenizer itself (messages/requests.py, PromptTokens).
Then one `TokenBatch` per step carries every sample's new tokens.
"""

from __future__ import annotations

import msgspec

from engine.messages.codec import Channel
from engine.messages.failures import RequestFailed
from engine.messages.kv_transfer import KvHandoff, KvSource
from engine.messages.params import SamplingParams
from engine.messages.steps import SampledLogprobs


class TenantTag(msgspec.Struct, array_like=True, frozen=True):
    """Whom a request runs for, as the scheduler needs it (engine/tenants/): the tenant's name,
    its weight in each step's fair share of tokens, and the prefix-cache scope its KV is keyed
    in (tenants of one scope share cached prefixes; the tenants file says which do)."""

    name: str
    weight: float = 1.0
    cache_scope: str = ""


class SampleResume(msgspec.Struct, array_like=True):
    """Restart sample `index` from prompt + `delivered_token_ids` (already sent to the client)."""

    index: int
    delivered_token_ids: list[int]


class SubmitRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    epoch: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: (
        int  # request seed (params.seed, or one the gateway drew); per-sample seeds derive from it
    )
    # None: a fresh request, all params.n samples. Otherwise only the listed samples run (the
    # others already finished).
    resume: list[SampleResume] | None = None
    # P/D disaggregation: `kv_handoff` asks a prefill instance to hold the prompt's KV after
    # the first token and say so (SampleDelta.handoff): "continue" when the request goes on
    # elsewhere in this launch (not if the first token ended it), "hold" whatever the first
    # token (another instance, told by the client, recomputes it); `kv_source` tells a decode
    # instance where the prompt's KV lies, to pull instead of computing it.
    kv_handoff: KvHandoff = ""
    kv_source: KvSource | None = None
    # Tenants (engine/tenants/): whom it runs for (None: the one tenant of a server without a
    # tenants file), vLLM's `priority` (lower runs first) and `cache_salt` (cached prefixes are
    # shared only among requests of one salt, within one tenant's scope).
    tenant: TenantTag | None = None
    priority: int = 0
    cache_salt: str | None = None


class TextParams(msgspec.Struct, array_like=True):
    """The detokenizer's part of SamplingParams."""

    stop: list[str]
    stop_token_ids: list[int]
    include_stop_str_in_output: bool
    skip_special_tokens: bool

    @classmethod
    def of(cls, params: SamplingParams) -> TextParams:
        return cls(
            params.stop,
            params.stop_token_ids,
            params.include_stop_str_in_output,
            params.skip_special_tokens,
        )


class TextStart(msgspec.Struct, tag=True, array_like=True):
    """Start (or, under a newer epoch, restart) a request's text: sent to the detokenizer once
    per request and epoch, ahead of its tokens."""

    request_id: str
    epoch: int
    num_samples: int  # params.n: the samples of a fresh request are 0 .. n-1
    params: TextParams
    context_token_ids: list[int]  # the prompt's last tokens: the first output decodes after them
    resume: list[SampleResume] | None = None  # as SubmitRequest.resume: what to prime with
    # The whole prompt, only with `prompt_logprobs` (they are named by its tokens).
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: bool = False


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    """Drop these requests, whatever their epoch (client gone, or finished by a stop string)."""

    request_ids: list[str]


class StopSamples(msgspec.Struct, tag=True, array_like=True):
    """Stop some samples of a request of this epoch (the detokenizer matched a stop string for
    them); the request's other samples keep running."""

    request_id: str
    epoch: int
    indices: list[int]


class FirstScheduled(msgspec.Struct, array_like=True):
    """Sent once per request and epoch, with its first sampled token: how many prompt tokens
    came from the prefix cache, and how long it waited and prefilled (seconds, scheduler clock).
    """

    num_cached_tokens: int
    queue_s: float
    prefill_s: float


class SampleDelta(msgspec.Struct, array_like=True):
    """What one sample gained in one step.

    finish_reason is "length" or "stop" when the sample ended with this delta. "stop" from the
    scheduler always means the last token is a stop token (eos or one of stop_token_ids): its
    text is left out unless include_stop_str_in_output. Stop strings are the detokenizer's.
    """

    request_id: str
    epoch: int
    index: int
    new_token_ids: list[int]
    logprobs: list[SampledLogprobs] | None = None  # one per new token, when the request asked
    finish_reason: str | None = None
    first: FirstScheduled | None = None  # on the request's first token of this epoch
    # With the same first token, when the request asked for them: prompt tokens 1.. logprobs.
    prompt_logprobs: list[SampledLogprobs] | None = None
    # Set on the first token of a request asked to hand off: the sample did not finish, but
    # this instance is done with it; it continues on a decode instance, its KV pulled from here.
    handoff: KvSource | None = None
    # An embedding request's vector (messages/steps.PooledVector's bytes), with its one token.
    embedding: bytes | None = None


class TokenBatch(msgspec.Struct, tag=True, array_like=True):
    items: list[SampleDelta]


class RequestStatus(msgspec.Struct, tag=True, kw_only=True):
    """One request as the admin "requests" listing shows it."""

    request_id: str
    epoch: int
    num_prompt_tokens: int
    num_output_tokens: list[int]  # per unfinished sample
    states: list[str]  # per unfinished sample: "waiting" | "running"
    num_preemptions: int
    age_s: float


class SchedulerFigures(msgspec.Struct, kw_only=True):
    """The scheduler's figures (zero until its first report)."""

    num_running: int = 0
    num_waiting: int = 0
    num_requests: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks owned by sequences
    num_free_blocks: int = 0
    num_cached_blocks: int = 0  # free blocks still holding reusable prefixes
    prefix_cache_hit_rate: float = 0.0  # hit tokens / queried tokens, since start
    prefix_cache_queried_tokens: int = 0  # since start: what the rate is made of, summable
    prefix_cache_hit_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    # Where a running batch's time goes (engine/scheduler/step_times.py); seconds since start.
    step_compute_seconds: float = 0.0  # rank 0, plan taken in to result ready, summed
    step_gaps: int = 0  # gaps between two steps of a running batch
    step_gap_seconds: float = 0.0  # the workers' wait in those gaps: result ready to next plan
    step_gap_scheduler_seconds: float = 0.0  # the scheduler's part: result read to plan sent
    # P/D disaggregation (all zero without kv_transfer actors); counts are since start.
    kv_holds: int = 0  # handed-off requests whose blocks are held for a puller now
    kv_pulls_in_flight: int = 0  # requests waiting for their KV now
    kv_handoffs: int = 0
    kv_holds_refused: int = 0  # handoffs not held: held blocks at their cap (a pool share)
    kv_holds_expired: int = 0  # freed by the hold timeout, not by an acknowledgement
    kv_pulls: int = 0  # pulls whose KV arrived
    kv_blocks_pulled: int = 0
    kv_bytes_pulled: int = 0
    kv_pull_seconds: float = 0.0  # summed over kv_pulls (divide for the mean latency)
    kv_fallbacks: int = 0  # requests that computed their prompt: their KV did not arrive
    kv_blocks_from_cache: int = 0  # source blocks the prefix cache had (not pulled)
    kv_refused_connections: int = 0  # KV connections refused: no proof of the deployment secret
    # The prefix cache's disk tier (engine/scheduler/disk_tier.py); counts are since start.
    kv_disk_hit_blocks: int = 0  # blocks read back from disk into the prefix cache
    kv_disk_read_bytes: int = 0
    kv_disk_written_blocks: int = 0
    kv_disk_written_bytes: int = 0
    kv_disk_evicted_blocks: int = 0  # files removed to keep the tier within its size
    kv_disk_dropped_blocks: int = 0  # files that failed their checks: removed, never served
    kv_disk_skipped_blocks: int = 0  # evicted from RAM before they could be written
    kv_disk_loads: int = 0  # reads of a request's blocks that ended
    kv_disk_loads_waiting: int = 0  # requests waiting for their blocks now
    kv_disk_unwritten_blocks: int = 0  # blocks waiting to be written, or being written, now
    kv_disk_full: int = 0  # schedulers whose disk is full (their writes stopped for now)
    # Speculative decoding (engine/scheduler/speculation.py), since start; vLLM's spec_decode_*.
    spec_decode_num_drafts: int = 0  # decode chunks that carried proposals
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # accepted_per_pos[i]: drafts whose proposal i (from 0) was accepted
    spec_decode_num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)


class SchedulerStats(SchedulerFigures, tag=True, kw_only=True):
    """What the scheduler reports of itself (messages/reports.py)."""


ToScheduler = SubmitRequest | AbortRequests | StopSamples | RequestFailed
FromScheduler = TextStart | AbortRequests | TokenBatch | RequestFailed

SCHEDULER_REQUESTS: Channel[ToScheduler] = Channel("scheduler-requests", ToScheduler)
SCHEDULER_OUTPUTS: Channel[FromScheduler] = Channel("scheduler-outputs", FromScheduler)
