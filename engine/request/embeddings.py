"""Embedding requests (vLLM's pooling runner) in the request policy's terms: an embedding is a
request of one sample and one step whose SamplingParams carry `pooling`; the engine's default
pooling comes from model.pooler_config, in vLLM's JSON form.

Pure: no I/O, no torch.
"""

from __future__ import annotations

import json

from engine.messages.params import POOLING_TYPES, PoolingParams, SamplingParams

POOLER_CONFIG_KEYS = ("pooling_type", "normalize")


def parse_pooler_config(text: str) -> PoolingParams:
    """model.pooler_config: '' (LAST, normalized) or vLLM's JSON, e.g. '{"pooling_type":
    "MEAN", "normalize": true}'; ValueError saying what is wrong."""
    if not text.strip():
        return PoolingParams()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"model.pooler_config must be a JSON object: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"model.pooler_config must be a JSON object, got {text!r}")
    unknown = sorted(set(raw) - set(POOLER_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"model.pooler_config has unknown key(s) {unknown}; known: {list(POOLER_CONFIG_KEYS)}"
        )
    kind = raw.get("pooling_type", "LAST")
    if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
        raise ValueError(
            f"model.pooler_config's pooling_type must be one of {list(POOLING_TYPES)}, got {kind!r}"
        )
    normalize = raw.get("normalize", True)
    if not isinstance(normalize, bool):
        raise ValueError(
            f"model.pooler_config's normalize must be true or false, got {normalize!r}"
        )
    return PoolingParams(pooling_type=kind.upper(), normalize=normalize)


def pooling_for(
    default: PoolingParams, pooling_type: str | None = None, normalize: bool | None = None
) -> PoolingParams:
    """The engine's default pooling with what a request names instead ("last", "mean" in any
    case); an unknown type is left for SamplingParams.validate to refuse by name."""
    kind = default.pooling_type if pooling_type is None else pooling_type.upper()
    return PoolingParams(
        pooling_type=kind, normalize=default.normalize if normalize is None else normalize
    )


def embedding_params(pooling: PoolingParams) -> SamplingParams:
    """An embedding request's SamplingParams: its prompt and one greedy step, no stop strings
    (the token sampled beside the vector is discarded)."""
    return SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
