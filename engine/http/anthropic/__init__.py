"""Anthropic's Messages API (/v1/messages): its wire shapes, and the adapter onto the chat path."""
