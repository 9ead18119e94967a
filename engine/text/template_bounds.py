"""Chat templates rendered within bounds: CPU time and output size, with nothing a template
writes able to spend either in one step.

A chat template is Jinja code run in transformers' sandbox, which keeps a template from Python's
internals but not from work: `{{ (9**(4782969*5)) % 7 }}` held a process (and its GIL) for 22 s
in one operation, and a nested loop of a hundred bytes rendered 30 M characters. Where a client
gives the template (/tokenize's `chat_template`), that is the client's code. So every template
is compiled in `BoundedSandbox`, transformers' own sandbox with:

- `**`, `*`, `+` and `%` intercepted: their result's size is judged from their operands before
  it is computed (an integer of over MAX_INT_BITS bits, a string or list over the output bound),
  which also stops Jinja from computing them while it compiles (it folds constant expressions,
  and an intercepted operator is never folded);
- `~` (concatenation) and the `join` filter judged the same way, and every call (method,
  filter, global) refused an integer argument over the output bound or a format string asking
  for a wider field;
- the output counted as it is rendered, refused past its bound;
- a CPU-time bound: past `seconds` of its own CPU time, the rendering thread gets an exception
  (at its next bytecode; the checks above keep any one operation short).

`render_bounded` sets the bounds for one rendering; the refusal is a `TemplateBoundError`
naming the bound, which the request's answer (400) repeats.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import compiler, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_INT_BITS = 1 << 16  # an integer of 20,000 digits: far past anything a prompt writes
_WIDE_FORMAT = re.compile(r"\d{7,}")  # a format field of a million characters or more
_SANDBOX_NAME = "ImmutableSandboxedEnvironment"
POLL_S = 0.05  # how often a rendering past its first `seconds` is looked at
WALL_FACTOR = 10  # wall-clock time allowed, in multiples of the CPU bound


class TemplateBoundError(ValueError):
    """A template went past one of its bounds; the message names it."""


class TemplateTimeout(TemplateBoundError):
    """Raised into a rendering thread past its deadline."""


@dataclass(frozen=True)
class Bounds:
    max_chars: int  # output, and any string, list or field width on the way
    seconds: float  # wall-clock time of one rendering


_BOUNDS: ContextVar[Bounds | None] = ContextVar("template_bounds", default=None)


@contextlib.contextmanager
def render_bounded(bounds: Bounds) -> Iterator[None]:
    """Renderings in this block, on this thread, keep to `bounds` (TemplateBoundError)."""
    token = _BOUNDS.set(bounds)
    try:
        with _deadline(bounds.seconds):
            yield
    finally:
        _BOUNDS.reset(token)


def _max_chars() -> int:
    bounds = _BOUNDS.get()
    return bounds.max_chars if bounds is not None else 1 << 30


def _refuse(what: str) -> TemplateBoundError:
    return TemplateBoundError(f"the chat template {what}")


def _check_size(value: Any) -> Any:
    limit = _max_chars()
    if isinstance(value, str | list | tuple) and len(value) > limit:
        raise _refuse(f"built a value of {len(value):,} items, over its bound of {limit:,}")
    return value


def _check_binop(operator: str, left: Any, right: Any) -> None:
    limit = _max_chars()
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        bits = max(left.bit_length(), 1) * right
        if bits > MAX_INT_BITS:
            raise _refuse(
                f"computes an integer power of about {bits:,} bits, over its bound of "
                f"{MAX_INT_BITS:,}"
            )
    elif operator == "*":
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise _refuse(f"computes a product over its bound of {MAX_INT_BITS:,} bits")
        else:
            size = _sequence_len(left) * _count(right) + _sequence_len(right) * _count(left)
            if size > limit:
                raise _refuse(f"repeats a value to {size:,} items, over its bound of {limit:,}")
    elif operator == "+" and _sequence_len(left) + _sequence_len(right) > limit:
        raise _refuse(f"concatenates values over its bound of {limit:,} characters")
    elif operator == "%" and isinstance(left, str) and _WIDE_FORMAT.search(left):
        raise _refuse("formats a field wider than its bound")


def _sequence_len(value: Any) -> int:
    return len(value) if isinstance(value, str | list | tuple) else 0


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _check_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    limit = _max_chars()
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > limit:
            raise _refuse(f"passes {value:,} to a call, over its bound of {limit:,}")


def _bounded_filter(function: Callable[..., Any]) -> Callable[..., Any]:
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_arguments(args, kwargs)
        if args and isinstance(args[0], str) and _WIDE_FORMAT.search(args[0]):
            raise _refuse("formats a field wider than its bound")
        return _check_size(function(*args, **kwargs))

    for attribute in ("jinja_pass_arg",):  # pass_context & co. mark a filter this way
        if hasattr(function, attribute):
            setattr(bounded, attribute, getattr(function, attribute))
    return bounded


@jinja2.pass_eval_context
def _bounded_join(
    eval_ctx: nodes.EvalContext, value: Any, separator: str = "", attribute: Any = None
) -> str:
    items, limit = list(value), _max_chars()
    if attribute is None and sum(len(str(item)) for item in items) > limit:
        raise _refuse(f"joins values over its bound of {limit:,} characters")
    return _check_size(jinja2.filters.do_join(eval_ctx, items, separator, attribute))  # type: ignore[no-any-return]


class _Filters(dict[str, Any]):
    """A filter table that bounds every filter put into it (transformers adds `tojson` after
    the environment is made)."""

    def __setitem__(self, name: str, function: Any) -> None:
        super().__setitem__(name, _bounded_join if name == "join" else _bounded_filter(function))


class _BoundedCodeGenerator(compiler.CodeGenerator):
    def visit_Concat(self, node: nodes.Concat, frame: compiler.Frame) -> None:
        self.write("environment.bounded(")
        super().visit_Concat(node, frame)
        self.write(")")


class BoundedTemplate(jinja2.Template):
    def render(self, *args: Any, **kwargs: Any) -> str:
        """Rendered with its output counted (TemplateBoundError past the bound)."""
        context = self.new_context(dict(*args, **kwargs))
        limit, size, parts = _max_chars(), 0, []
        try:
            for part in self.root_render_func(context):
                size += len(part)
                if size > limit:
                    raise _refuse(f"rendered over {limit:,} characters, its bound")
                parts.append(part)
        except TemplateBoundError:
            raise
        except Exception:
            self.environment.handle_exception()
        return "".join(parts)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"**", "*", "+", "%"})
    code_generator_class = _BoundedCodeGenerator
    template_class = BoundedTemplate

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        filters, self.filters = self.filters, _Filters()
        for name, function in filters.items():
            self.filters[name] = function

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return _check_size(super().call_binop(context, operator, left, right))

    def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_arguments(args, kwargs)
        owner, method = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
        if isinstance(owner, str) and method == "replace" and args:
            _check_replace(owner, *args[:2])
        return _check_size(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """A string's format method (the sandbox wraps it where it is looked up): one asking
        for a field wider than the bound is refused when called."""
        owner = getattr(value, "__self__", None)
        if isinstance(owner, str) and _WIDE_FORMAT.search(owner):

            def refused(*args: Any, **kwargs: Any) -> str:
                raise _refuse("formats a field wider than its bound")

            return refused
        return super().wrap_str_format(value)

    @staticmethod
    def bounded(value: str) -> str:
        return _check_size(value)  # type: ignore[no-any-return]


def _check_replace(text: str, old: Any, new: Any = "") -> None:
    if isinstance(old, str) and isinstance(new, str):
        times = len(text) + 1 if old == "" else text.count(old)
        if len(text) + times * max(0, len(new) - len(old)) > _max_chars():
            raise _refuse(f"replaces text past its bound of {_max_chars():,} characters")


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """TemplateTimeout raised into this thread once it has spent `seconds` of CPU time in the
    block (its own CPU clock, so a loaded machine does not count), or ten times that of wall
    time; again every POLL_S while it still runs (code on the way may catch a first one)."""
    thread_id = threading.get_ident()
    clock = time.pthread_getcpuclockid(thread_id)
    started, wall_started = time.clock_gettime(clock), time.monotonic()
    lock = threading.Lock()
    state = {"active": True, "fired": False}

    def poll() -> None:
        with lock:
            if not state["active"]:
                return
            spent = time.clock_gettime(clock) - started
            if spent > seconds or time.monotonic() - wall_started > WALL_FACTOR * seconds:
                state["fired"] = True
                _raise_in(thread_id, TemplateTimeout)
            again = threading.Timer(POLL_S, poll)
            again.daemon = True
            again.start()

    timer = threading.Timer(seconds, poll)  # CPU time cannot run ahead of wall time
    timer.daemon = True
    timer.start()
    try:
        yield
    except TemplateTimeout:
        raise TemplateTimeout(
            f"the chat template ran past its bound of {seconds:g} CPU seconds and was stopped"
        ) from None
    finally:
        timer.cancel()
        with lock:
            state["active"] = False
            if state["fired"]:  # maybe not delivered yet: it must never land elsewhere
                _raise_in(thread_id, None)


def _raise_in(thread_id: int, exception: type[BaseException] | None) -> None:
    target = ctypes.py_object(exception) if exception is not None else None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), target)


def install() -> None:
    """Make transformers compile every chat template in BoundedSandbox (idempotent): its own
    sandbox, with its own filters and globals, under the bounds above."""
    from engine.text.hf_tokenizer import import_transformers_without_torch

    import_transformers_without_torch()  # as the tokenizer actor loads it: never torch
    from transformers.utils import chat_template_utils

    # transformers builds its sandbox by this module-level name when it compiles a template.
    if getattr(chat_template_utils, _SANDBOX_NAME) is not BoundedSandbox:
        setattr(chat_template_utils, _SANDBOX_NAME, BoundedSandbox)
        chat_template_utils._compile_jinja_template.cache_clear()  # compiled unbounded
