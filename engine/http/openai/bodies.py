"""Engine outputs → OpenAI response bodies and SSE events.

The engine yields deltas per sample; `ResponseBuilder` keeps what a response needs across them
(text, token counts, finish reasons, logprobs) and shapes both the one-shot body and the streamed
chunks, for completions and chat alike. No I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine.http.openai.chat_output import ChatAnswer, tool_calls_out
from engine.http.openai.echo import EchoedPrompt, vllm_prompt_logprobs
from engine.http.openai.parsing import OpenAIRequest
from engine.http.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    PromptLogprobsOut,
    PromptTokensDetails,
    TopLogprob,
    Usage,
    encode,
)
from engine.request.outputs import CompletionOutput, Logprob, RequestOutput

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


@dataclass
class ChoiceState:
    index: int
    text_parts: list[str] = field(default_factory=list)
    text_length: int = 0
    num_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[Logprob] = field(default_factory=list)
    stop_reason: str | int | None = None
    token_ids: list[int] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class ResponseBuilder:
    def __init__(
        self,
        api: OpenAIRequest,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        self.api = api
        if api.tool_plan is not None and api.tool_plan.mode == "auto":
            api.tool_plan.parser = tool_call_parser
            if tool_call_parser is None:  # nothing reads calls: the answer is plain content
                api.tool_plan = None
        self._reasoning = reasoning_parser is not None
        self._answers: dict[int, ChatAnswer] = {}  # chat: each choice's answer, shaped
        # Made as outputs arrive, not up front: n x prompts is only known to be within the
        # limits once the engine has admitted the request.
        self._choices: dict[int, ChoiceState] = {}
        self.prompt_tokens: dict[int, int] = {}
        self.prompt_token_ids: dict[int, list[int]] = {}  # return_token_ids only
        self.cached_tokens: dict[int, int] = {}  # per prompt, once the scheduler reported it
        self.echoed: dict[int, EchoedPrompt] = {}  # per prompt, with echo (set by the run)
        self.prompt_logprobs: dict[int, list[Logprob | None]] = {}  # per prompt, when asked
        self.kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's (P/D)
        self._echo_sent: set[int] = set()  # choices whose stream has had its echo
        self._prompt_ids_sent: set[int] = set()  # choices whose stream has had the prompt's ids

    @property
    def choices(self) -> list[ChoiceState]:
        """Every choice in index order (those without output yet empty); read only once the
        engine has admitted the request."""
        return [self._choices.get(i) or ChoiceState(i) for i in range(self.api.num_choices)]

    # ------------------------------------------------------------ absorbing engine output

    def absorb(
        self, prompt_index: int, out: RequestOutput
    ) -> list[tuple[ChoiceState, int, CompletionOutput]]:
        """Record one engine yield; return each advanced choice, its text offset before, delta."""
        self.prompt_tokens[prompt_index] = len(out.prompt_token_ids)
        if self.api.return_token_ids:
            self.prompt_token_ids[prompt_index] = out.prompt_token_ids
        if out.num_cached_tokens is not None:
            self.cached_tokens[prompt_index] = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = out.prompt_logprobs
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params
        advanced = []
        for delta in out.outputs:
            if self.api.echo_only:  # the token generated to end the request is not shown
                finish = None if delta.finish_reason is None else "length"
                delta = CompletionOutput(delta.index, "", [], finish)
            key = prompt_index * self.api.n + delta.index
            choice = self._choices.get(key) or self._choices.setdefault(key, ChoiceState(key))
            offset = choice.text_length
            _apply(choice, delta)
            advanced.append((choice, offset, delta))
        return advanced

    def usage(self) -> Usage:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(c.num_tokens for c in self._choices.values())
        details: PromptTokensDetails | msgspec.UnsetType = msgspec.UNSET
        if self.cached_tokens:
            details = PromptTokensDetails(cached_tokens=sum(self.cached_tokens.values()))
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=details,
        )

    def _kv_transfer_params(self) -> dict[str, Any] | msgspec.UnsetType | None:
        """What a prefill instance answers (P/D): where to pull the KV from; null when it holds
        none (left out when the request did not ask)."""
        if not self.api.kv_transfer_asked:
            return msgspec.UNSET
        return self.kv_transfer_params

    def _token_ids(self, ids: list[int]) -> list[int] | msgspec.UnsetType:
        return list(ids) if self.api.return_token_ids else msgspec.UNSET

    def _prompt_ids(self, choice_index: int) -> list[int] | msgspec.UnsetType:
        if not self.api.return_token_ids:
            return msgspec.UNSET
        return self.prompt_token_ids.get(choice_index // self.api.n, [])

    # ------------------------------------------------------------ one-shot bodies

    def final_body(self) -> bytes:
        p = self.api
        if p.kind == "completion":
            return encode(
                CompletionResponse(
                    id=p.request_id,
                    created=p.created,
                    model=p.model,
                    choices=[
                        CompletionChoice(
                            index=c.index,
                            text=self._echo_text(c.index) + c.text,
                            logprobs=self._completion_logprobs(
                                [*self._echo_logprobs(c.index), *c.logprobs], 0, c.index
                            ),
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                            prompt_token_ids=self._prompt_ids(c.index),
                            token_ids=self._token_ids(c.token_ids),
                            prompt_logprobs=self._vllm_prompt_logprobs(c.index),
                        )
                        for c in self.choices
                    ],
                    usage=self.usage(),
                    kv_transfer_params=self._kv_transfer_params(),
                )
            )
        return encode(
            ChatCompletionResponse(
                id=p.request_id,
                created=p.created,
                model=p.model,
                choices=[self._chat_choice(c) for c in self.choices],
                usage=self.usage(),
                prompt_token_ids=self._prompt_ids(0),
                prompt_logprobs=self._vllm_prompt_logprobs(0),
                kv_transfer_params=self._kv_transfer_params(),
            )
        )

    # ------------------------------------------------------------ streamed events

    def opening_events(self) -> list[bytes]:
        """Chat streams open with the assistant role for every choice, as OpenAI's do."""
        if self.api.kind != "chat":
            return []
        return [
            self._chat_chunk(
                [
                    ChatChunkChoice(
                        index=index,
                        delta=ChatDelta(role="assistant", content=""),
                        logprobs=None,
                        finish_reason=None,
                    )
                ]
            )
            for index in range(self.api.num_choices)  # sent once the engine admitted them
        ]

    def delta_events(self, prompt_index: int, out: RequestOutput) -> list[bytes]:
        """Absorb one engine yield and return its SSE events (one per advanced choice)."""
        events = []
        for choice, offset, delta in self.absorb(prompt_index, out):
            entries = delta.logprobs or []
            # The prompt's ids go with each choice's first chunk (return_token_ids). Not told by
            # the token count: one engine yield may carry several deltas of a choice (outputs
            # queued while the client was slow), absorbed together before their chunks are made.
            first = choice.index not in self._prompt_ids_sent
            prompt_ids = self._prompt_ids(choice.index) if first else msgspec.UNSET
            if self.api.kind == "completion":
                echo = choice.index not in self._echo_sent  # the prompt goes first, once
                self._echo_sent.add(choice.index)
                shown: list[Logprob | None] = [*entries]
                if echo:
                    shown = [*self._echo_logprobs(choice.index), *entries]
                else:
                    offset += len(self._echo_text(choice.index))
                chunk_choice = CompletionChoice(
                    index=choice.index,
                    text=(self._echo_text(choice.index) if echo else "") + delta.text,
                    logprobs=self._completion_logprobs(shown, offset, choice.index),
                    finish_reason=delta.finish_reason,
                    stop_reason=delta.stop_reason,
                    prompt_token_ids=prompt_ids,
                    token_ids=self._token_ids(delta.token_ids),
                    prompt_logprobs=self._vllm_prompt_logprobs(choice.index)
                    if echo
                    else msgspec.UNSET,
                )
                events.append(self._completion_chunk([chunk_choice]))
                self._prompt_ids_sent.add(choice.index)
            else:
                finished = delta.finish_reason is not None
                shaped, called = self.answer(choice.index).delta(choice.text, finished)
                finish_reason = "tool_calls" if called else delta.finish_reason
                held = shaped is None and not finished and not entries
                if held and not self.api.return_token_ids:
                    continue  # held back (a tag may be starting, or tool calls are forming)
                chat_choice = ChatChunkChoice(
                    index=choice.index,
                    delta=shaped or ChatDelta(),
                    logprobs=self._chat_logprobs(entries),
                    finish_reason=finish_reason,
                    stop_reason=delta.stop_reason,
                    token_ids=self._token_ids(delta.token_ids),
                )
                events.append(self._chat_chunk([chat_choice], prompt_token_ids=prompt_ids))
                self._prompt_ids_sent.add(choice.index)
        return events

    def answer(self, index: int) -> ChatAnswer:
        answer = self._answers.get(index)
        if answer is None:
            answer = ChatAnswer(self.api.tool_plan, self._reasoning)
            self._answers[index] = answer
        return answer

    def _chat_choice(self, c: ChoiceState) -> ChatChoice:
        content, reasoning, calls = self.answer(c.index).final(c.text)
        finish_reason = "tool_calls" if calls else c.finish_reason
        message = ChatMessageOut(
            role="assistant",
            content=content,
            reasoning_content=reasoning,
            tool_calls=tool_calls_out(calls),
        )
        return ChatChoice(
            index=c.index,
            message=message,
            logprobs=self._chat_logprobs(c.logprobs),
            finish_reason=finish_reason,
            stop_reason=c.stop_reason,
            token_ids=self._token_ids(c.token_ids),
        )

    def usage_event(self) -> bytes:
        if self.api.kind == "completion":
            return self._completion_chunk([], usage=self.usage())
        return self._chat_chunk([], usage=self.usage())

    def _completion_chunk(
        self, choices: list[CompletionChoice], usage: Usage | msgspec.UnsetType = msgspec.UNSET
    ) -> bytes:
        p = self.api
        chunk = CompletionChunk(
            id=p.request_id, created=p.created, model=p.model, choices=choices, usage=usage
        )
        return sse_event(encode(chunk))

    def _chat_chunk(
        self,
        choices: list[ChatChunkChoice],
        usage: Usage | msgspec.UnsetType = msgspec.UNSET,
        prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET,
    ) -> bytes:
        p = self.api
        chunk = ChatCompletionChunk(
            id=p.request_id,
            created=p.created,
            model=p.model,
            choices=choices,
            usage=usage,
            prompt_token_ids=prompt_token_ids,
        )
        return sse_event(encode(chunk))

    # ------------------------------------------------------------ echo (completions)

    def _echo_text(self, choice_index: int) -> str:
        echoed = self.echoed.get(choice_index // self.api.n)
        return "" if echoed is None else echoed.text

    def _echo_logprobs(self, choice_index: int) -> list[Logprob | None]:
        """An echoed prompt's tokens' logprobs (None for the first), when logprobs are asked."""
        if not (self.api.echo and self.api.want_logprobs):
            return []
        return self.prompt_logprobs.get(choice_index // self.api.n, [])

    def _vllm_prompt_logprobs(self, choice_index: int) -> PromptLogprobsOut | msgspec.UnsetType:
        if not self.api.want_prompt_logprobs:
            return msgspec.UNSET
        return vllm_prompt_logprobs(self.prompt_logprobs.get(choice_index // self.api.n, []))

    # ------------------------------------------------------------ logprobs shapes

    def _completion_logprobs(
        self, entries: list[Logprob | None], text_offset: int, choice_index: int
    ) -> CompletionLogprobs | None:
        if not self.api.want_logprobs:
            return None
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        offset = text_offset
        for entry in entries:
            top: dict[str, float] | None = None
            if entry is None:  # an echoed prompt's first token: nothing before it to score it
                echoed = self.echoed.get(choice_index // self.api.n)
                token, logprob = ("" if echoed is None else echoed.first_token), None
            else:
                token, logprob = entry.token, entry.logprob
                top = {alt.token: alt.logprob for alt in entry.top}
                top.setdefault(token, entry.logprob)
            tokens.append(token)
            token_logprobs.append(logprob)
            tops.append(top)
            offsets.append(offset)
            offset += len(token)
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=token_logprobs, top_logprobs=tops, text_offset=offsets
        )

    def _chat_logprobs(self, entries: list[Logprob]) -> ChatLogprobs | None:
        if not self.api.want_logprobs:
            return None
        content = [
            ChatTokenLogprob(
                token=entry.token,
                logprob=entry.logprob,
                bytes=list(entry.token.encode()),
                top_logprobs=[
                    TopLogprob(
                        token=alt.token,
                        logprob=alt.logprob,
                        bytes=list(alt.token.encode()),
                    )
                    for alt in entry.top
                ],
            )
            for entry in entries
        ]
        return ChatLogprobs(content=content)


def _apply(choice: ChoiceState, delta: CompletionOutput) -> None:
    choice.text_parts.append(delta.text)
    choice.text_length += len(delta.text)
    choice.num_tokens += len(delta.token_ids)
    choice.token_ids.extend(delta.token_ids)
    if delta.logprobs:
        choice.logprobs.extend(delta.logprobs)
    if delta.finish_reason is not None:
        choice.finish_reason = delta.finish_reason
        choice.stop_reason = delta.stop_reason
