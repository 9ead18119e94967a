"""What clients speak over HTTP: OpenAI's API (openai/), Anthropic's Messages API (anthropic/),
the routes that adapt the Responses and Messages APIs onto the chat path, and the streamed
response whose clean-up runs once however it ends (used by the proxy too).

Import-light: nothing here imports the engine or torch at package import.
"""
