"""The grammar library's limits, one set for admission and for the worker, and the trial run
that finds a constraint past them before the request is admitted.

llguidance bounds what a grammar may cost (`LLParserLimits`): items in one parser row, fuel for
building the lexer and for each step, lexer states, grammar symbols. A grammar past one of them
does not fail to compile: its matcher enters an error state when it meets the limit, often on
the first byte it consumes, and an error state looks like a finished grammar. So admission runs
the grammar for a few bytes with a tokenizer of single bytes (torch-free, tokenizer-free, cheap:
the limits bound the work), with the very limits the worker compiles with; a grammar that stops
there is a 400 naming the limit. One that meets a limit later, on the model's own tokens, fails
its request at the worker with the same message (engine/structured/grammars.py), never as an
unconstrained answer.

Errors are short (`verbose_errors` off: llguidance would print the grammar and the parser state
into them), and what is logged of a grammar is its size and hash, never its text.
"""

from __future__ import annotations

from typing import Any

import llguidance
from llguidance._tokenizer import TokenizerWrapper

# llguidance's defaults, except the lexer's initial fuel: at its default (1,000,000) a regex such
# as (a{1000}){1000} spends most of a minute in its lexer before it fails, on the step path; at a
# tenth it fails within the admission's trial, while a{20000}, JSON schemas of a thousand
# properties and 2,000-way choices still compile.
LIMITS: dict[str, int] = {
    "max_items_in_row": 2000,
    "initial_lexer_fuel": 100_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
    "max_lexer_states": 250_000,
    "max_grammar_size": 500_000,
}
TRIAL_BYTES = 16  # bytes a trial run consumes (fewer when the grammar ends sooner)
# Which limits an error message of the library's says was met (its stop reason does not say:
# a matcher that stops on a token reports an internal error).
_LIMITS_MET_BY: list[tuple[str, tuple[str, ...]]] = [
    ("row has", ("max_items_in_row",)),
    ("lexer", ("initial_lexer_fuel", "step_lexer_fuel", "max_lexer_states")),
    ("items", ("step_max_items",)),
    ("grammar size", ("max_grammar_size",)),
    ("too large", ("max_grammar_size",)),
]


class ConstraintError(ValueError):
    """A constraint the grammar library refused or stopped on: the request's fault (a 400)."""


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(
        max_items_in_row=LIMITS["max_items_in_row"],
        initial_lexer_fuel=LIMITS["initial_lexer_fuel"],
        step_lexer_fuel=LIMITS["step_lexer_fuel"],
        step_max_items=LIMITS["step_max_items"],
        max_lexer_states=LIMITS["max_lexer_states"],
        max_grammar_size=LIMITS["max_grammar_size"],
        verbose_errors=False,  # else errors carry the grammar and the parser's state
    )


def why_refused(error: str) -> str:
    """What the log may say of a refusal: the limits met, never the error's quotes of the
    grammar."""
    names = limits_met(error)
    return f"met llguidance's {', '.join(names)}" if names else "not a valid constraint"


def limits_met(error: str) -> tuple[str, ...]:
    """The limits an error of the library's names as met; () for any other error."""
    lowered = error.lower()
    return next((names for words, names in _LIMITS_MET_BY if words in lowered), ())


def matcher_error(matcher: llguidance.LLMatcher, field: str) -> ConstraintError:
    """The error a matcher stopped on, naming the limit it met when it met one."""
    error = matcher.get_error().replace("<non-verbose/>", "").strip()
    names = limits_met(error)
    if not names:
        return ConstraintError(f"{field} cannot be enforced: {error}")
    limits = ", ".join(f"{name} {LIMITS[name]:,}" for name in names)
    return ConstraintError(
        f"{field} exceeds the grammar library's limits (llguidance {limits}): {error}"
    )


def trial_run(grammar: str, field: str) -> None:
    """ConstraintError when `grammar` cannot be compiled or stops on a limit within its first
    TRIAL_BYTES bytes (always taking the lowest byte allowed)."""
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0, limits=parser_limits())
    for _ in range(TRIAL_BYTES):
        if matcher.is_error():
            raise matcher_error(matcher, field)
        if matcher.is_stopped():
            return
        allowed = matcher.compute_logit_bias()
        if matcher.is_error():
            raise matcher_error(matcher, field)
        following = next((byte for byte in range(256) if allowed[byte]), None)
        if following is None:
            return  # only the end may follow
        matcher.consume_token(following)
    if matcher.is_error():
        raise matcher_error(matcher, field)


class _Bytes:
    """A tokenizer whose tokens are the 256 bytes, then an end token."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([value]) for value in range(256)] + [b"<end>"]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


_BYTE_TOKENIZER: list[Any] = []


def _byte_tokenizer() -> llguidance.LLTokenizer:
    if not _BYTE_TOKENIZER:
        _BYTE_TOKENIZER.append(llguidance.LLTokenizer(TokenizerWrapper(_Bytes())))
    tokenizer: llguidance.LLTokenizer = _BYTE_TOKENIZER[0]
    return tokenizer
