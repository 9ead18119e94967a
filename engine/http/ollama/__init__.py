"""Ollama's API (routes.py), run on the engine's models as the OpenAI API is."""
