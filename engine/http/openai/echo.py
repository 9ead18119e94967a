"""Scoring a prompt through the API: `echo` (completions: the prompt, and with `logprobs` its
tokens' logprobs, before the completion; with `max_tokens` 0 the prompt alone) and vLLM's
`prompt_logprobs` field. The engine computes the logprobs (SamplingParams.prompt_logprobs);
this module shapes them."""

from __future__ import annotations

from dataclasses import dataclass

from engine.http.openai.protocol import PromptLogprob, PromptLogprobsOut
from engine.request.outputs import Logprob


@dataclass(frozen=True)
class EchoedPrompt:
    text: str  # what the completion's text starts with
    first_token: str  # the prompt's first token, which has no logprob (nothing precedes it)


def vllm_prompt_logprobs(entries: list[Logprob | None]) -> PromptLogprobsOut:
    """vLLM's shape: per prompt token, None for the first, else {token id: logprob, rank among
    the top alternatives (None when it is not among them), text} for it and its alternatives."""
    shaped: PromptLogprobsOut = []
    for entry in entries:
        if entry is None:
            shaped.append(None)
            continue
        ranks = {alt.token_id: rank for rank, alt in enumerate(entry.top, start=1)}
        by_id = {
            str(alt.token_id): PromptLogprob(
                logprob=alt.logprob, rank=ranks[alt.token_id], decoded_token=alt.token
            )
            for alt in entry.top
        }
        by_id.setdefault(
            str(entry.token_id),
            PromptLogprob(
                logprob=entry.logprob, rank=ranks.get(entry.token_id), decoded_token=entry.token
            ),
        )
        shaped.append(by_id)
    return shaped
