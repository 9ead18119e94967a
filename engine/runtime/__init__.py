"""Generic actor runtime: rings, mailboxes, actors, supervision. Knows nothing about LLMs."""
