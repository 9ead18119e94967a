"""Chat templates rendered within bounds (engine/text/template_bounds.py), through the same
PromptBuilder the tokenizer actor renders every chat with: each attack of issue 46 is refused
naming its bound, quickly, and a model's own template renders as transformers renders it."""

from __future__ import annotations

import time
from typing import Any

import pytest

from engine.messages.requests import ChatMessage, ChatOptions
from engine.text.hf_tokenizer import load_tokenizer_without_torch
from engine.text.prompt import PromptBuilder
from engine.text.template_bounds import Bounds, TemplateBoundError, TemplateTimeout
from tests.checkpoints import tiny_checkpoint

MESSAGES = [ChatMessage("user", "hi"), ChatMessage("assistant", "hello"), ChatMessage("user", "ok")]


@pytest.fixture(scope="module")
def builder() -> PromptBuilder:
    tokenizer = load_tokenizer_without_torch(str(tiny_checkpoint()))
    return PromptBuilder(tokenizer, 1024, len(tokenizer), template_bounds=Bounds(32_768, 0.5))


def render(builder: PromptBuilder, template: str) -> list[int]:
    return builder.chat_token_ids(MESSAGES, ChatOptions(template=template))


@pytest.mark.parametrize(
    ("template", "bound"),
    [
        # held the process, and its GIL, for 22 s in one operation (Jinja folded it at compile)
        ("{{ (9**(4782969*5)) % 7 }}", "integer power of about 95,659,380 bits"),
        # ~100 bytes rendering 30 M characters
        (
            "{% for a in messages * 9999 %}{% for b in messages * 9999 %}x{% endfor %}{% endfor %}",
            "rendered over 32,768 characters",
        ),
        (
            "{% set s = namespace(x='ab') %}{% for i in range(40) %}{% set s.x = s.x ~ s.x %}"
            "{% endfor %}",
            "built a value of",
        ),
        ("{{ 'x' * 100000000 }}", "repeats a value to 100,000,000 items"),
        ("{{ 'a'|center(999999999) }}", "passes 999,999,999 to a call"),
        ("{{ '{:999999999}'.format(1) }}", "formats a field wider than its bound"),
        ("{{ 'abc'.replace('', 'x' * 20000) }}", "replaces text past its bound"),
    ],
)
def test_a_template_past_a_bound_is_refused_naming_it(
    builder: PromptBuilder, template: str, bound: str
) -> None:
    started = time.process_time()
    with pytest.raises(TemplateBoundError, match=bound):
        render(builder, template)
    assert time.process_time() - started < 5  # none got to run long (a bound, not a timing)


def test_a_template_that_loops_without_output_is_stopped_at_its_cpu_bound(
    builder: PromptBuilder,
) -> None:
    loop = "{% for a in range(30000) %}{% for b in range(30000) %}{% endfor %}{% endfor %}"
    with pytest.raises(TemplateTimeout, match=r"past its bound of 0\.5 CPU seconds"):
        render(builder, loop)
    assert render(builder, "{{ messages[0].content }}")  # the thread renders again afterwards


def test_a_models_template_renders_as_transformers_renders_it(builder: PromptBuilder) -> None:
    tokenizer: Any = builder.tokenizer
    conversation = [{"role": m.role, "content": m.content} for m in MESSAGES]
    rendered = tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )
    expected = tokenizer.encode(rendered, add_special_tokens=False)
    assert builder.chat_token_ids(MESSAGES, ChatOptions()) == expected
