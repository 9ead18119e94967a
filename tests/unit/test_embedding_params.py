"""Embedding requests' parameters: model.pooler_config in vLLM's JSON, refused at start with one
line naming it; SamplingParams with pooling refuse what an embedding cannot be; and the worker's
running MEAN keeps a rerun step's sums once."""

from __future__ import annotations

import pytest
import torch

from engine.messages.params import PoolingParams, SamplingParams
from engine.messages.vectors import float32_values
from engine.model.pooling import Pooling
from engine.model.step_inputs import SeqChunk, SequenceStart
from engine.request.embeddings import embedding_params
from engine.settings import SettingsError, load_settings


def test_pooler_config_takes_vllms_json_and_refuses_the_rest_naming_it() -> None:
    settings, _ = load_settings(["--pooler-config", '{"pooling_type": "mean"}'], {})
    assert PoolingParams.from_config(settings.model.pooler_config) == PoolingParams(
        pooling_type="MEAN", normalize=True
    )
    settings, _ = load_settings(["--override-pooler-config", '{"normalize": false}'], {})
    assert PoolingParams.from_config(settings.model.pooler_config).normalize is False
    for bad, words in [
        ('{"pooling_type": "MAX"}', "pooling_type must be one of ['LAST', 'MEAN'], got 'MAX'"),
        ('{"pooling": "MEAN"}', "unknown key(s) ['pooling']"),
        ('{"normalize": "yes"}', "normalize must be true or false"),
        ("MEAN", "must be a JSON object"),
    ]:
        with pytest.raises(SettingsError) as caught:
            load_settings(["--pooler-config", bad], {})
        assert "model.pooler_config" in str(caught.value) and words in str(caught.value)


def test_an_embedding_is_one_sample_of_one_step() -> None:
    embedding_params(PoolingParams(pooling_type="MEAN")).validate()
    for field, value in [("n", 2), ("max_tokens", 5)]:
        params = SamplingParams(pooling=PoolingParams(), **{field: value})  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=f"^{field} must be 1 for an embedding request"):
            params.validate()
    with pytest.raises(ValueError, match=r"^pooling_type must be one of"):
        embedding_params(PoolingParams(pooling_type="CLS")).validate()


def test_a_mean_over_chunks_counts_a_rerun_step_once() -> None:
    pooling = Pooling()
    params = embedding_params(PoolingParams(pooling_type="MEAN", normalize=False))
    pooling.watch(SequenceStart(7, list(range(5)), [], params, 0))
    hidden = torch.arange(10, dtype=torch.float32).reshape(5, 2)  # a row per prompt position
    first = [SeqChunk(7, [1, 2, 3], 0, [0], False)]
    step = pooling.plan(first)
    assert pooling.pool(step, hidden[:3]) == []
    assert pooling.pool(step, hidden[:3]) == []  # the step failed and ran again
    pooling.commit()
    last = [SeqChunk(7, [4, 5], 3, [0], True)]
    [vector] = pooling.pool(pooling.plan(last), hidden[3:])
    assert vector.seq_id == 7
    assert float32_values(vector.values) == hidden.mean(dim=0).tolist()
