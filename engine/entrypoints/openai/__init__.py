"""OpenAI's API as vLLM serves it: the wire protocol, request parsing, completions, chat,
responses, embeddings, tokenize, the runs that relay engine outputs, and the state and metrics
the handlers share with the admin socket."""
