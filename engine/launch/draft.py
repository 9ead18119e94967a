"""Speculative decoding's draft model at launch: found, and checked against the target before
any actor starts, so that a draft the workers could not use stops the launch with one line; and
what it takes of a rank's memory, which the KV cache's size leaves room for."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, TypedDict

from engine.launch.model_source import model_directory
from engine.model.config import ModelConfig, load_model_config
from engine.model.placement.capacity import kv_block_bytes
from engine.model.placement.policy import device_type, resident_weight_bytes
from engine.model.quantized.formats import quantized_bytes, quantized_formats
from engine.scheduler.speculation import parse_speculative_config
from engine.settings import Settings, resolve_home


class DraftFields(TypedDict):
    draft_model_path: str
    draft_rejection_sampling: bool


def draft_worker_fields(settings: Settings, target_path: str, target: ModelConfig) -> DraftFields:
    """WorkerConfig's draft fields: the checkpoint (see draft_model_path) and whether sampled
    proposals are verified by vLLM's rejection sampler ("acceptance_method"), which deterministic
    mode refuses: its draws would depend on which positions were drafted."""
    path = draft_model_path(settings, target_path, target)
    config = parse_speculative_config(settings.scheduler.speculative_config)
    rejection = (
        bool(path) and config is not None and config.acceptance_method == "rejection_sampler"
    )
    if rejection and settings.model.deterministic:
        raise ValueError(
            'speculative_config acceptance_method "rejection_sampler" cannot run in deterministic '
            "mode: its tokens depend on which positions were drafted; use the default "
            '"target_draw"'
        )
    return {"draft_model_path": path, "draft_rejection_sampling": rejection}


class DraftFootprint(NamedTuple):
    """What a draft model takes of the rank that runs it, besides the target."""

    weight_bytes: int  # resident, as the target's are counted
    block_bytes: int  # one block of its KV cache, which has as many blocks as the target's


def draft_footprint(path: str, block_size: int, dtype: str, device: str) -> DraftFootprint | None:
    """The footprint of the draft at `path` ("": no draft, None), loaded as rank 0 loads it:
    unsharded, in the target's dtype, its own GGUF quantization if any."""
    if not path:
        return None
    config = load_model_config(path)
    quantized = quantized_formats(path, config, "auto", on_cpu=device_type(device) == "cpu")
    weights = resident_weight_bytes(config, dtype, 1, device, quantized_bytes(quantized, config))
    return DraftFootprint(weights, kv_block_bytes(config, block_size, dtype))


def draft_model_path(settings: Settings, target_path: str, target: ModelConfig) -> str:
    """The checkpoint directory of --speculative-config's "model" ("" when none is named).

    ValueError when it cannot serve as the target's draft: another vocabulary, or a topology
    the draft does not run in (it runs on worker rank 0, unsharded)."""
    config = parse_speculative_config(settings.scheduler.speculative_config)
    if config is None or not config.model:
        return ""
    if settings.parallel.tensor_parallel_size > 1:
        raise ValueError(
            "speculative_config: a draft model runs with tensor_parallel_size 1 only (it runs "
            f"unsharded on rank 0); got {settings.parallel.tensor_parallel_size}"
        )
    path, _ = model_directory(config.model, resolve_home(settings))
    draft = load_model_config(path)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config model {config.model!r} has a vocabulary of {draft.vocab_size} "
            f"tokens, the model's has {target.vocab_size}: a draft model must share its tokenizer"
        )
    draft_vocab, target_vocab = _tokenizer_vocab(path), _tokenizer_vocab(target_path)
    if draft_vocab is not None and target_vocab is not None and draft_vocab != target_vocab:
        differing = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()))
        raise ValueError(
            f"speculative_config model {config.model!r} has another tokenizer than the model "
            f"({len(differing)} token entries differ, e.g. {differing[0]!r}): a draft model "
            "must share its tokenizer"
        )
    return path


def _tokenizer_vocab(checkpoint: str) -> dict[str, int] | None:
    """The checkpoint's tokenizer vocabulary with its added tokens; None without
    tokenizer.json (then only the vocabulary sizes are compared)."""
    file = Path(checkpoint) / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    vocab: dict[str, int] = Tokenizer.from_str(file.read_text(encoding="utf-8")).get_vocab(
        with_added_tokens=True
    )
    return vocab
