"""Span and event names and attribute keys: vLLM's (vllm/tracing.py SpanAttributes, the GenAI
semantic conventions of its time), so that a trace backend's vLLM views read our spans as they
are; ours where vLLM has none."""

from __future__ import annotations

REQUEST_SPAN = "llm_request"  # vLLM's name for the request's span

# vLLM's attribute keys
RESPONSE_MODEL = "gen_ai.response.model"
REQUEST_ID = "gen_ai.request.id"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_N = "gen_ai.request.n"
USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
LATENCY_E2E = "gen_ai.latency.e2e"
LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"

# The GenAI conventions' key for how each choice ended (vLLM sets none)
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"

# Ours
PROMPT_CACHED_TOKENS = "engine.prompt.cached_tokens"  # prompt tokens the prefix cache had
RESTARTS = "engine.restarts"  # actor restarts the request lived through (resubmissions)
RESTART_EVENT = "restart"  # an event on the request's span, one per resubmission
EVENT_EPOCH = "engine.epoch"  # the epoch it was resubmitted under

# Child spans, one per hop of the request's path (on the root's clock, see spans.py)
TOKENIZE_SPAN = "tokenizer"
QUEUE_SPAN = "scheduler.queue"
PREFILL_SPAN = "worker.prefill"
DECODE_SPAN = "decode"
