"""The library API: `LLM` (blocking, vLLM's offline interface), `AsyncLLM` (the engine on an
event loop), and embeddings through them. What they return is engine/request/outputs.py, below
this package, since the registry of requests in flight and the actors build those objects too."""
