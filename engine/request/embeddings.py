"""Embedding requests (vLLM's pooling runner) in the request policy's terms: an embedding is a
request of one sample and one step whose SamplingParams carry `pooling`; the engine's default
pooling comes from model.pooler_config, in vLLM's JSON form (PoolingParams.from_config).

Pure: no I/O, no torch.
"""

from __future__ import annotations

from engine.messages.params import PoolingParams, SamplingParams


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
