"""What rank 0 makes of a step's logits: the batched sampler, its counter-based randomness, the
token-level controls (bias, allowed and bad words, grammars) and prompt logprobs."""
