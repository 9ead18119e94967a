"""engine: an LLM serving engine built as supervised actors."""
