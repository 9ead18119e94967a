"""The P/D proxy (`engine proxy`): one OpenAI endpoint in front of prefill and decode instances.

It probes every instance, sends each request's prefill to a prefill instance and its decode to a
decode instance, and relays the stream back. It runs in its own process and talks to instances
over HTTP only; it imports nothing from the engine's actors.
"""
