"""The library API: `LLM` (blocking, vLLM's offline interface), `AsyncLLM` (the engine on an
event loop), and embeddings through them. What they return is engine/outputs.py, below this
package, since the gateway and the actors build those objects too."""
