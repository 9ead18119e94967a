"""HTTP front: OpenAI-compatible API (Starlette), SSE, metrics, and the admin socket server.

Kept import-light: the app, launcher and admin server are imported from their modules.
"""
