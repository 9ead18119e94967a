"""A request's `kv_transfer_params` (P/D across instances, as vLLM's proxy sends them): what
they ask of this instance.

- `{"do_remote_decode": true}` to a prefill instance: compute the prompt and one token, then
  hold the prompt's KV for a decode instance; the answer carries the `kv_transfer_params` to
  give that decode instance.
- those `kv_transfer_params` to a decode instance: pull the prompt's KV from where they say
  instead of computing it (what cannot be pulled is computed).

An instance of role both (colocated) serves the request by itself and ignores them, as an engine
without a KV connector does. They are decoded into typed structs (never unpickled): anything
else is a 400 naming `kv_transfer_params`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from engine.messages.kv_transfer import KvHandoff, KvSource
from engine.outputs import EngineError

PARAM = "kv_transfer_params"


def kv_directives(params: Mapping[str, Any] | None, role: str) -> tuple[KvHandoff, KvSource | None]:
    """(the handoff mode, the KV source) these params ask of an instance of `role`."""
    if not params or role == "both":
        return "", None
    if params.get("do_remote_decode"):
        if role != "prefill":
            raise EngineError(
                f"kv_transfer_params.do_remote_decode asks for a prefill instance; this one "
                f"was started with --kv-role {role}",
                400,
                PARAM,
            )
        return "hold", None
    if role != "decode":
        raise EngineError(
            "kv_transfer_params naming a KV source are for a decode instance; this one was "
            "started with --kv-role prefill",
            400,
            PARAM,
        )
    try:
        return "", msgspec.convert(dict(params), KvSource)
    except msgspec.ValidationError as exc:
        raise EngineError(
            f"kv_transfer_params is not a KV source a prefill instance of this engine gave: {exc}",
            400,
            PARAM,
        ) from None
