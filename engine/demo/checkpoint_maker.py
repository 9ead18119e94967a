"""Make seeded random checkpoints of any size in the Hugging Face layout, offline.

The model is built by transformers itself (`XForCausalLM(config)`) and saved with
`save_pretrained`, so transformers and vLLM load the result like any downloaded checkpoint.
Weights are redrawn from one seeded generator (not transformers' init, which may change between
versions), with a larger spread than training init so greedy decoding wanders over the vocabulary
instead of repeating one token; norm weights and biases are random too, so a loader that swaps
or drops them produces different logits and gets caught.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ARCH_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "ministral": ("MinistralConfig", "MinistralForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}
_ATTENTION_BIAS = ("llama", "qwen3")  # the architectures whose config takes attention_bias
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    arch: str = "qwen3"  # a key of ARCH_CLASSES
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # default hidden_size // num_heads
    intermediate_size: int = 192
    vocab_size: int = 512
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # e.g. {"rope_type": "linear", "factor": 2.0}
    max_position_embeddings: int = 4096
    attention_bias: bool = False  # llama / qwen3 only; qwen2 always has q/k/v bias
    dtype: str = "float32"
    init_std: float = 0.25
    seed: int = 0
    max_shard_size: str | None = None  # e.g. "200KB": save as several shards with an index
    # More of the config class's arguments, as they are (a window, experts, soft-capping...).
    extra: dict[str, Any] | None = None

    def validate(self) -> None:
        if self.arch not in ARCH_CLASSES:
            raise ValueError(f"unknown arch {self.arch!r}; expected one of {sorted(ARCH_CLASSES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected one of {DTYPES}")
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_heads "
                f"({self.num_heads}) unless head_dim is given"
            )
        if self.init_std <= 0:
            raise ValueError(f"init_std must be > 0, got {self.init_std}")


def make_checkpoint(out_dir: str | Path, spec: CheckpointSpec, corpus: str | None = None) -> Path:
    """Write config, weights, tokenizer and generation config for `spec` into `out_dir`."""
    import torch
    import transformers

    from engine.demo.tokenizer_maker import END_OF_TEXT, IM_END, train_bpe_tokenizer

    spec.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe_tokenizer(spec.vocab_size, corpus)
    eos_id = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    assert isinstance(eos_id, int)  # one token in, one id out
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)

    config_class, model_class = (getattr(transformers, n) for n in ARCH_CLASSES[spec.arch])
    config = config_class(**_config_kwargs(spec, eos_id))
    with torch.device("cpu"):
        model = model_class(config)
    _randomize(model, spec)
    model.to(getattr(torch, spec.dtype))
    save_kwargs: dict[str, Any] = {}
    if spec.max_shard_size is not None:
        save_kwargs["max_shard_size"] = spec.max_shard_size
    model.generation_config = transformers.GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=eos_id, eos_token_id=[eos_id, im_end_id], pad_token_id=eos_id
    )
    model.save_pretrained(out, **save_kwargs)
    tokenizer.save_pretrained(out)
    _make_tokenizer_config_portable(out)
    (out / "engine_checkpoint.json").write_text(
        json.dumps(
            {"made_by": "engine.demo.checkpoint_maker", **dataclasses.asdict(spec)}, indent=2
        )
    )
    log.info("made a random %s checkpoint in %s", spec.arch, out)
    return out


def _make_tokenizer_config_portable(out: Path) -> None:
    """transformers 5 names its tokenizer class TokenizersBackend and keeps the chat template in
    chat_template.jinja; transformers 4 (which some vLLM builds pin) knows neither. Name the
    class both understand and inline the template and special tokens as well."""
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = config.get("extra_special_tokens")
    if isinstance(extra, list):
        config.setdefault("additional_special_tokens", extra)
    template = out / "chat_template.jinja"
    if template.is_file():
        config.setdefault("chat_template", template.read_text())
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def _config_kwargs(spec: CheckpointSpec, eos_id: int) -> dict[str, Any]:
    head_dim = spec.head_dim or spec.hidden_size // spec.num_heads
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.rope_scaling:
        rope = {"rope_theta": spec.rope_theta, **spec.rope_scaling}
    kwargs: dict[str, Any] = {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "rope_parameters": rope,
        "initializer_range": spec.init_std,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "dtype": spec.dtype,
    }
    if spec.arch in _ATTENTION_BIAS:
        kwargs["attention_bias"] = spec.attention_bias
    return {**kwargs, **(spec.extra or {})}


def _randomize(model: Any, spec: CheckpointSpec) -> None:
    """Redraw every parameter from one generator seeded by `spec.seed`, in name order."""
    import torch

    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)  # around 1, but not 1: mapping errors show
            else:
                param.copy_(spec.init_std * noise)
