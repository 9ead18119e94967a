"""OpenAI's API as vLLM serves it: the wire protocol, request parsing, completions, chat,
embeddings, tokenize, LoRA routes, the runs that relay engine outputs, and the Responses API
(responses/)."""
