"""Token ids to text: incremental detokenization, stop strings, per-request streams (no torch)."""

from engine.text.detokenizer import Detokenizer, DetokenizerOutput
from engine.text.incremental import IncrementalDetokenizer, as_decoder
from engine.text.stop_strings import StopStrings
from engine.text.stream import SampleTextStream

__all__ = [
    "Detokenizer",
    "DetokenizerOutput",
    "IncrementalDetokenizer",
    "SampleTextStream",
    "StopStrings",
    "as_decoder",
]
