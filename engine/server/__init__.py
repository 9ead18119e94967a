"""The HTTP server process around the APIs: the Starlette app, the launcher (uvicorn, sockets,
pidfile, systemd notify), connection guards, the request log and the chat page.

Kept import-light: the app and launcher are imported from their modules.
"""
