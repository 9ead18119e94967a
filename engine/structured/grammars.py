"""Worker rank 0's grammar service: compiles constraints off the step path, one matcher each.

A constraint is compiled when its sequence is first seen (a thread pool; llguidance releases the
GIL while it builds a parser), cached by spec with an LRU bound, and each sequence gets a copy of
the compiled matcher. A step blocks only when it needs a mask whose grammar is not ready yet.
A sequence's matcher is a function of its constraint and its output tokens: it is rebuilt by
feeding the delivered tokens, which is what lets a constrained request resume after a restart.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance

from engine.messages.params import StructuredOutputsParams
from engine.structured.limits import (
    limits_met,
    matcher_error,
    parser_limits,
    why_refused,
)
from engine.structured.spec import constraint_summary, grammar_of, spec_key

log = logging.getLogger(__name__)

FIELD = "structured_outputs"
COMPILE_TIMEOUT_S = 60.0  # a step waits at most this for a grammar (then its sequence fails)
COMPILE_THREADS = 4
MAX_CACHED_GRAMMARS = 256


class GrammarService:
    """Compiled grammars and the tokenizer they need, for one model."""

    def __init__(
        self,
        model_path: str,
        vocab_size: int,
        eos_token_ids: list[int],
        max_cached: int = MAX_CACHED_GRAMMARS,
    ) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size  # the logits' width: the bitmask covers every row column
        self.eos_token_ids = list(eos_token_ids)
        self.max_cached = max_cached
        # Several at once (llguidance builds a grammar without the GIL): requests that arrive
        # together with large constraints must not queue behind one another's compiles.
        threads = max(1, min(COMPILE_THREADS, os.cpu_count() or 1))
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._tokenizers: Future[tuple[Any, llguidance.LLTokenizer]] | None = None
        self._compiled: OrderedDict[bytes, Future[llguidance.LLMatcher]] = OrderedDict()
        self.executor = llguidance.LLExecutor(num_threads=max(1, min(4, os.cpu_count() or 1)))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def compile(self, spec: StructuredOutputsParams) -> Future[llguidance.LLMatcher]:
        """The compiled matcher of `spec` (a template: copy it per sequence), started now."""
        key = spec_key(spec)
        with self._lock:
            found = self._compiled.get(key)
            if found is not None:
                self._compiled.move_to_end(key)
                return found
            future = self._pool.submit(self._compile, spec)
            self._compiled[key] = future
            while len(self._compiled) > self.max_cached:
                self._compiled.popitem(last=False)
            return future

    def hf_tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (bad_words are tokenized with it)."""
        return self._load().result(timeout=COMPILE_TIMEOUT_S)[0]

    def _load(self) -> Future[tuple[Any, llguidance.LLTokenizer]]:
        with self._lock:
            if self._tokenizers is None:
                self._tokenizers = Future()
                tokenizers = self._tokenizers
            else:
                return self._tokenizers
        try:
            tokenizers.set_result(self._load_tokenizers())
        except Exception as exc:
            tokenizers.set_exception(exc)
        return tokenizers

    def _load_tokenizers(self) -> tuple[Any, llguidance.LLTokenizer]:
        import llguidance.hf
        from transformers import AutoTokenizer

        hf: Any = AutoTokenizer.from_pretrained(self.model_path)
        # The model's logits width, not the tokenizer's length: ids past the tokenizer's are
        # never allowed by a grammar, and the bitmask must cover every logit column.
        ll = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
        return hf, ll

    def _compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        ll_tokenizer = self._load().result(timeout=COMPILE_TIMEOUT_S)[1]
        grammar = grammar_of(spec)
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0, limits=parser_limits())
        if matcher.is_error():
            error = matcher_error(matcher, FIELD)
            summary = constraint_summary(spec)
            log.warning("structured_outputs refused (%s): %s", summary, why_refused(str(error)))
            raise error
        return matcher


class GrammarsBusy(RuntimeError):
    """A grammar still compiling when its sequence must be sampled: the server is busy (503),
    not broken, and the request may be sent again."""


class SequenceMatcher:
    """One sequence's grammar state, fed its output tokens as they are sampled (or delivered
    before a restart)."""

    def __init__(self, compiled: Future[llguidance.LLMatcher]) -> None:
        self._compiled = compiled
        self._matcher: llguidance.LLMatcher | None = None
        self._fed = 0  # output tokens the matcher has consumed

    def ready(self, output: list[int]) -> llguidance.LLMatcher:
        """The matcher, caught up with `output` (waits for the grammar if it is still compiling)."""
        if self._matcher is None:
            try:
                compiled = self._compiled.result(timeout=COMPILE_TIMEOUT_S)
            except TimeoutError:
                raise GrammarsBusy(
                    f"structured_outputs: the grammar did not compile within "
                    f"{COMPILE_TIMEOUT_S:g} s, behind others; try again"
                ) from None
            self._matcher = compiled.deep_copy()
        matcher = self._matcher
        while self._fed < len(output):
            token = output[self._fed]
            if matcher.is_stopped():
                break  # EOS, or the grammar's end: later tokens (if any) are past the output
            if not matcher.consume_token(token):
                if limits_met(matcher.get_error()):  # a limit met on the model's tokens
                    raise matcher_error(matcher, FIELD)
                raise ValueError(
                    f"token {token} at output position {self._fed} breaks the structured "
                    f"output constraint: {matcher.get_error()}"
                )
            self._fed += 1
        if matcher.is_error():  # never taken for the grammar's end: that would free the output
            raise matcher_error(matcher, FIELD)
        return matcher
