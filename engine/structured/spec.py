"""A request's structured-output constraint → the llguidance grammar that enforces it.

Torch-free and tokenizer-free: the gateway checks every constraint here before any compute, so
an invalid schema, regex or grammar is a 400 naming the problem, and the worker compiles only
grammars known to be valid. llguidance's grammar checks need neither torch nor a tokenizer, and
the gateway never imports torch (it would cost every start seconds and hundreds of MB), which is
why llguidance serves here rather than xgrammar, whose import brings torch and transformers;
both compile a JSON schema quickly.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, cast

import llguidance
import msgspec
from llguidance.gbnf_to_lark import any_to_lark

from engine.messages.params import StructuredOutputsParams
from engine.structured.limits import parser_limits, trial_run

# JSON is generated compact (", " and ": " separators, no free whitespace): a model may not spend
# its tokens on whitespace, which an unconstrained-whitespace grammar allows without end.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


def grammar_of(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of `spec`; ValueError naming the field when it cannot be built.
    (Validity is checked by `check_structured_outputs`.)"""
    if spec.json is not None:
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        return _json_grammar(schema, "structured_outputs.json")
    if spec.json_object:
        return _json_grammar({"type": "object"}, "structured_outputs.json_object")
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        if not spec.choice:
            raise ValueError("structured_outputs.choice must list at least one string")
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(option) for option in spec.choice)
        )
    if spec.grammar is not None:
        try:
            lark = any_to_lark(spec.grammar)  # GBNF (llama.cpp's) or Lark, as vLLM accepts
        except Exception as exc:
            raise ValueError(f"structured_outputs.grammar does not parse: {exc}") from None
        return llguidance.LLMatcher.grammar_from_lark(lark)
    raise ValueError("structured_outputs sets no constraint")


def _json_grammar(schema: dict[str, Any] | bool, field: str) -> str:
    text = json.dumps(schema)  # a bare `true` / `false` schema too
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            text, defaults=cast(Any, _JSON_OPTIONS)
        )
    except Exception as exc:  # the schema's structure is refused before any grammar exists
        raise ValueError(f"{field} is not a usable JSON schema: {exc}") from None


def check_structured_outputs(spec: StructuredOutputsParams, max_chars: int) -> None:
    """The cheap checks, on the caller's thread: ValueError starting with the offending field
    when `spec` sets no constraint or several, or one over `max_chars` characters
    (limits.max_grammar_chars). `check_grammar` does the rest, off the event loop."""
    unsupported = spec.unsupported()
    if unsupported:
        raise ValueError(f"structured_outputs.{unsupported[0]} is not supported")
    kinds = spec.kinds()
    if len(kinds) != 1:
        raise ValueError(
            "structured_outputs must set exactly one of json, json_object, regex, choice, "
            f"grammar; got {kinds or 'none'}"
        )
    size = constraint_chars(spec)
    if size > max_chars:
        raise ValueError(
            f"structured_outputs.{kinds[0]} has {size:,} characters, over the limit of "
            f"{max_chars:,} (limits.max_grammar_chars)"
        )


def constraint_chars(spec: StructuredOutputsParams) -> int:
    """The size of what a request gave as its constraint, in characters."""
    if spec.json is not None:
        return len(spec.json if isinstance(spec.json, str) else json.dumps(spec.json))
    if spec.regex is not None:
        return len(spec.regex)
    if spec.choice is not None:
        return sum(len(option) + 1 for option in spec.choice)
    return len(spec.grammar or "")


def check_grammar(spec: StructuredOutputsParams) -> str:
    """The grammar of `spec` once the library has taken it within its limits (LIMITS) and run
    it for a few bytes (`trial_run`); ValueError naming the field, and the limit met, when it
    cannot be enforced. Seconds for the largest constraints `check_structured_outputs` lets
    through: not for an event loop."""
    field = f"structured_outputs.{spec.kinds()[0]}"
    try:
        grammar = grammar_of(spec)
        error = llguidance.LLMatcher.validate_grammar(grammar, limits=parser_limits())
    except ValueError:
        raise
    except Exception as exc:  # the library's own refusal of an input it cannot take
        raise ValueError(f"{field} is invalid: {exc}") from None
    if error:
        raise ValueError(f"{field} is invalid: {error.replace('<non-verbose/>', '').strip()}")
    trial_run(grammar, field)
    return grammar


def constraint_summary(spec: StructuredOutputsParams) -> str:
    """What the log may say of a constraint: its size and a hash, never its text."""
    digest = hashlib.sha256(spec_key(spec)).hexdigest()[:16]
    return f"{spec.kinds()[0]}, {constraint_chars(spec):,} characters, sha256 {digest}"


def spec_key(spec: StructuredOutputsParams) -> bytes:
    """Equal for equal constraints: the key of the worker's compiled-grammar cache."""
    return msgspec.msgpack.encode(spec)
