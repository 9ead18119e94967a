"""One sample's text: incremental detokenization + stop strings + what the client has seen."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.messages.params import SamplingParams
from engine.messages.scheduling import TextParams
from engine.text.incremental import IncrementalDetokenizer
from engine.text.stop_strings import StopStrings


class SampleTextStream:
    """Turns a sample's tokens into text deltas, ending it at a stop string.

    Everything it sends is a function of the token sequence alone (not of how tokens were
    batched), so a stream primed with the tokens a client already received sends exactly
    what the original stream would have sent next: after a restart, text continues seamlessly.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        params: TextParams | SamplingParams,  # it reads the text parameters alone
        delivered_token_ids: Sequence[int] = (),
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.skip_special_tokens
        )
        self._stops = StopStrings(params.stop, params.include_stop_str_in_output)
        self._stop_token_ids = frozenset(params.stop_token_ids)
        self.text = ""  # decoded so far (cut at the stop string once one is found)
        self.sent = 0  # characters of `text` the client has
        self.finish_reason: str | None = None
        # vLLM's stop_reason: the stop string matched or the stop token id; None for EOS/length.
        self.stop_reason: str | int | None = None
        for token_id in delivered_token_ids:
            if self._append(token_id):
                break
        self.sent = self._releasable()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, token_ids: Sequence[int], finish_reason: str | None = None) -> str:
        """New tokens (and the scheduler's finish reason, if this ends the sample); returns the
        text the client may have now. Afterwards `finish_reason` says whether the sample ended:
        "stop" also when a stop string matched (then the scheduler must be told to stop it).

        A scheduler "stop" means the last token is a stop token (EOS or stop_token_ids): its
        text is left out unless include_stop_str_in_output.
        """
        if self.finished:
            return ""
        for position, token_id in enumerate(token_ids):
            is_stop_token = finish_reason == "stop" and position == len(token_ids) - 1
            if is_stop_token and not self._stops.include_in_output:
                break
            if self._append(token_id):
                break
        if not self.finished and finish_reason is not None:
            self._add_text(self._detokenizer.flush())
            if not self.finished:
                self.finish_reason = finish_reason
                if (
                    finish_reason == "stop"
                    and token_ids[-1:]
                    and token_ids[-1] in self._stop_token_ids
                ):
                    self.stop_reason = token_ids[-1]
        new_text = self.text[self.sent : self._releasable()]
        self.sent += len(new_text)
        return new_text

    def _append(self, token_id: int) -> bool:
        """Decode one more token; True when a stop string ended the sample."""
        return self._add_text(self._detokenizer.step(token_id))

    def _add_text(self, piece: str) -> bool:
        if not piece:
            return False
        start = len(self.text)
        self.text += piece
        cut = self._stops.find_cut(self.text, start)
        if cut is None:
            return False
        self.text = self.text[:cut]
        self.finish_reason = "stop"
        self.stop_reason = self._stops.matched
        return True

    def _releasable(self) -> int:
        if self.finished:
            return len(self.text)
        return max(self.sent, len(self.text) - self._stops.hold_back)
