"""HTTP in one place: the Starlette app (app.py), its state (state.py), the connection guards
(connections.py), the server process around it (launcher.py, pidfile, systemd notify, the
request log), the server's metrics, and one sub-package per API: `openai/` (completions, chat,
embeddings, tokenize, the Responses API), `anthropic/` (the Messages API), `admin/` (the admin
socket) and `ui/` (the chat page).

Kept import-light: the app and launcher are imported from their modules.
"""
