"""Speculative decoding on the worker: the draft model's proposals and their verification."""
