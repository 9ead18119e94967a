"""Train a small byte-level BPE tokenizer (GPT-2 / Qwen style) on local text, offline.

Byte-level means every string is encodable (unknown characters fall back to their UTF-8 bytes),
so a tokenizer trained on a few hundred kilobytes of prose still round-trips any input.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:  # transformers (and with it torch) is imported only when training
    from transformers import PreTrainedTokenizerFast

DEFAULT_CORPUS = Path(__file__).with_name("default_corpus.txt")
END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END]
BYTE_ALPHABET_SIZE = 256

# ChatML, as Qwen models use it; tools, tool calls and tool results rendered as Qwen2.5/Qwen3's
# template renders them (Hermes-style <tool_call> JSON), and Qwen3's enable_thinking=False
# (an empty <think></think> opening the answer).
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>'
    "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools and loop.first %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set function = call['function'] if call.get('function') else call %}"
    "{{- '\\n<tool_call>\\n{\\\"name\\\": \\\"' + function['name'] + '\\\", "
    "\\\"arguments\\\": ' + (function['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def min_vocab_size() -> int:
    return BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)


def train_bpe_tokenizer(vocab_size: int, corpus: str | None = None) -> PreTrainedTokenizerFast:
    """A tokenizer of exactly `vocab_size` ids (special tokens first: 0, 1, 2), trained on
    `corpus` (default: the bundled text). Deterministic: the same inputs give the same merges."""
    from transformers import PreTrainedTokenizerFast

    if vocab_size < min_vocab_size():
        raise ValueError(
            f"vocab_size {vocab_size} is too small; a byte-level BPE tokenizer needs at least "
            f"{min_vocab_size()} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )
    text = DEFAULT_CORPUS.read_text(encoding="utf-8") if corpus is None else corpus
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # One document per paragraph: merges never span paragraph breaks. A title-cased copy of the
    # text gives capitalised words their own tokens (and a small corpus enough merges for ~8k).
    paragraphs = _paragraphs(text)
    tokenizer.train_from_iterator(paragraphs + [p.title() for p in paragraphs], trainer=trainer)
    # Every id the model can emit must decode: fill any shortfall with reserved special tokens
    # (as Llama 3 does), since a random model samples the whole vocabulary.
    shortfall = vocab_size - tokenizer.get_vocab_size()
    tokenizer.add_special_tokens(
        [AddedToken(f"<|reserved_{i}|>", special=True) for i in range(shortfall)]
    )
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHATML_TEMPLATE,
        model_max_length=1 << 30,
        clean_up_tokenization_spaces=False,
    )


def _paragraphs(text: str) -> list[str]:
    return [p for p in text.split("\n\n") if p.strip()]
