"""OpenAI wire structs: request bodies (decoded, typed, by msgspec) and response bodies.

Field names follow OpenAI's API; sampling extensions use vLLM's names (top_k, min_p, ...).
Unknown request fields are ignored, as OpenAI clients send fields a server may not support.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from engine.messages.params import StructuredOutputsParams

# ---------------------------------------------------------------- requests

# Integer bounds. JSON integers are unbounded and msgspec decodes them into Python ints, but
# what the engine accepts must travel on its msgpack wire (64-bit at most) and fit its tensors.
# Lower bounds of counts are SamplingParams.validate's (its messages name the API's rule).
MAX_COUNT = 2**31 - 1
Count = Annotated[int, msgspec.Meta(le=MAX_COUNT)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]  # vLLM's: a signed 64-bit seed


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class TextPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class FunctionCallIn(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(msgspec.Struct, kw_only=True):
    id: str | None = None
    type: str = "function"
    function: FunctionCallIn


class ChatMessageIn(msgspec.Struct, kw_only=True):
    role: str  # checked in parsing, so the error can list the roles accepted
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str  # text | json_object | json_schema (checked in parsing, to name the choices)
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolIn(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: NamedFunction


class _UnimplementedFields(msgspec.Struct, kw_only=True):
    """Fields of OpenAI's or vLLM's API that change the output and that this server does not
    implement: decoded with the rest of the body (once) so that a request setting one to
    anything but its neutral value is refused (output_controls.refuse_unimplemented), never
    silently served as if it had not asked."""

    suffix: Any = None
    best_of: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    chat_template: Any = None
    continue_final_message: Any = None
    add_generation_prompt: Any = None
    documents: Any = None
    logits_processors: Any = None
    truncate_prompt_tokens: Any = None
    guided_whitespace_pattern: Any = None
    mm_processor_kwargs: Any = None
    verbosity: Any = None
    spaces_between_special_tokens: Any = None
    return_tokens_as_token_ids: Any = None
    vllm_xargs: Any = None


UNIMPLEMENTED_FIELDS = _UnimplementedFields.__struct_fields__


class _SamplingFields(_UnimplementedFields, kw_only=True):
    """Fields both endpoints share."""

    model: str | None = None
    max_tokens: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Count = 1  # its limit is limits.max_n, checked with the request's other limits
    stop: str | list[str] | None = None
    seed: Seed | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions
    top_k: Count | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    repeat_last_n: Count | None = None  # llama.cpp's and Ollama's window for repetition_penalty
    min_tokens: Count = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM: return the prompt's and each choice's token ids; the request's id (or X-Request-Id)
    return_token_ids: bool = False
    request_id: str | None = None
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs, this many top
    # Output controls (engine/http/openai/output_controls.py maps them onto SamplingParams)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: str | dict[str, Any] | None = None  # vLLM's older names of structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    # P/D across instances (vLLM's field; engine/inflight/kv_params.py says what it asks)
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's: lower runs first, within the tenant's priority_ceiling; cached prefixes are
    # shared only among requests with the same salt (engine/tenants/access.py checks both)
    priority: int | None = None
    cache_salt: str | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]: msgspec allows one array type per union,
    # so elements are typed here and their mix is checked in parsing.
    prompt: str | list[str | TokenId | list[TokenId]]
    logprobs: int | None = None
    echo: bool = False


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessageIn]
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolIn] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# ---------------------------------------------------------------- responses


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Once the scheduler has reported the prompt's cache hits (UNSET: left out)
    prompt_tokens_details: PromptTokensDetails | msgspec.UnsetType = msgspec.UNSET


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token (nothing before it)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct, kw_only=True):
    """vLLM's shape of one entry of `prompt_logprobs` (keyed by the token id, as a string)."""

    logprob: float
    rank: int | None
    decoded_token: str


PromptLogprobsOut = list[dict[str, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    # return_token_ids only (UNSET fields are left out of the JSON)
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    prompt_logprobs: PromptLogprobsOut | msgspec.UnsetType = msgspec.UNSET  # when asked for


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
    object: str = "text_completion"
    kv_transfer_params: dict[str, Any] | msgspec.UnsetType | None = msgspec.UNSET  # prefill P/D


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob]


class FunctionCallOut(msgspec.Struct, kw_only=True):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct, kw_only=True):
    id: str
    function: FunctionCallOut
    type: str = "function"


class ToolCallDelta(msgspec.Struct, kw_only=True):
    index: int
    id: str
    function: FunctionCallOut
    type: str = "function"


class ChatMessageOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str | None  # None (null) when the answer is tool calls
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # return_token_ids only


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # return_token_ids only
    prompt_logprobs: PromptLogprobsOut | msgspec.UnsetType = msgspec.UNSET  # when asked for
    kv_transfer_params: dict[str, Any] | msgspec.UnsetType | None = msgspec.UNSET  # prefill P/D


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # return_token_ids only


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    # Only in the last chunk, and only with stream_options.include_usage (UNSET: left out)
    usage: Usage | msgspec.UnsetType = msgspec.UNSET
    object: str = "chat.completion.chunk"
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # return_token_ids only


class CompletionChunk(msgspec.Struct, kw_only=True):
    """A streamed completions event (OpenAI reuses the non-streamed object name)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | msgspec.UnsetType = msgspec.UNSET  # as ChatCompletionChunk's
    object: str = "text_completion"


class ModelStatus(msgspec.Struct, kw_only=True):
    """A catalogue model's state, as llama-server's router shows it (`value`), and ours."""

    value: str  # loaded | loading | unloading | unloaded | failed
    in_flight: int = 0
    memory_bytes: int = 0
    loads: int = 0
    last_load_seconds: float = 0.0
    expires_in: float | None = None  # seconds until keep_alive unloads it; None: not armed
    error: str | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    created: int
    max_model_len: int | None  # None: not known until the model is loaded
    object: str = "model"
    owned_by: str = "engine"
    root: str | None = None  # a LoRA adapter's path; a catalogue model's file or directory
    parent: str | None = None  # a LoRA adapter's base model (its served name)
    aliases: list[str] | None = None  # other names of a catalogue model
    status: ModelStatus | None = None


class ModelList(msgspec.Struct, kw_only=True):
    data: list[ModelCard]
    object: str = "list"


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(msgspec.Struct, kw_only=True):
    error: ErrorDetail


def encode(obj: Any) -> bytes:
    return _ENCODER.encode(obj)


_ENCODER = msgspec.json.Encoder()
