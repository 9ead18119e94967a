"""Structured outputs: a request's constraint (JSON schema, regex, choice, grammar) as an
llguidance grammar, checked where the request enters (spec, torch-free), matched per sequence
and applied to the logits as one batched token bitmask on worker rank 0 (grammars, bitmask)."""
