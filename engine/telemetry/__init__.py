"""OpenTelemetry traces of requests (`--otlp-traces-endpoint`, as vLLM's flag).

The root process builds one span per request when it ends (spans.py), from what the gateway
already keeps of it: arrival, the scheduler's first report (queue and prefill time), first
token, restarts it lived through. Nothing is timed on the request path, and no actor knows
about tracing. The SDK is the optional extra `engine[otel]`, imported only when an endpoint
is set (tracer.py).
"""
