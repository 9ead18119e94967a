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

# ChatML, as Qwen models use it.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
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
    return PreTrainedTokenizerFast(
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
