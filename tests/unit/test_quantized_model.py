"""Weights served quantized: a GGUF file's block types stay in them (every matmul and the
embedding table, float parameters left as empty placeholders), float checkpoints quantize at
load with --quantization, the logits stay close to the dequantized model's, a row's result does
not depend on its batch in deterministic mode, and the memory plan counts the packed bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.gguf.checkpoint import prepare_checkpoint
from engine.model.config import load_model_config
from engine.model.loading.weight_names import matrix_shapes
from engine.model.placement import policy as placement
from engine.model.runner import ModelRunner
from engine.model.step_inputs import SeqChunk
from engine.quantization.layout import packed_bytes
from engine.quantization.quantize import quantize
from tests.checkpoints import BlockAllocator, tiny_checkpoint
from tests.gguf_files import gguf_of

PROMPT = [5, 17, 300, 42, 9, 77, 120, 260, 3, 3, 400, 11]
OTHER = [8, 1, 2, 99, 31, 64, 250]
# (architecture, overrides, GGUF types): 4-bit and 8-bit codes, biases, qk-norm, and a mix
# within one fused weight (q and k in Q4_0, v in Q8_0) as llama.cpp's K_M files have.
GGUF_CASES = [
    ("llama", {"tie_word_embeddings": True}, "Q4_1"),
    ("qwen2", {}, "Q4_0"),
    ("qwen3", {"num_kv_heads": 1}, "Q8_0"),
    ("llama", {}, "Q4_0,attn_v=Q8_0,ffn_down=Q5_1"),
]


def runner(
    path: Path, quantization: str, backend: str = "auto", kv_cache_dtype: str = "auto"
) -> ModelRunner:
    return ModelRunner(
        str(path),
        dtype="float32",
        kv_cache_memory=1 << 20,
        block_size=16,
        quantization=quantization,
        kernel_backend=backend,
        kv_cache_dtype=kv_cache_dtype,
    )


def logits_of(model: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    allocator = BlockAllocator(model.num_blocks)
    chunks = [SeqChunk(i, p, 0, allocator.allocate(1), True) for i, p in enumerate(prompts)]
    return model.forward(chunks)


def assert_close_to(quantized: torch.Tensor, reference: torch.Tensor) -> None:
    """Int8 activations (one scale per 32 values) move a matmul's outputs by ~0.5 % of their
    largest; through a random tiny model's layers the logits move by up to ~10 % of theirs
    (measured: 3-10 %), and keep their direction. (Top tokens of a random model are too close
    to compare: the default model's test compares its greedy answers.)"""
    spread = float(reference.abs().max())
    assert float((quantized - reference).abs().max()) <= 0.15 * spread
    assert float(torch.cosine_similarity(quantized, reference, dim=-1).min()) > 0.99


@pytest.mark.parametrize("case", GGUF_CASES, ids=lambda c: f"{c[0]}-{c[2]}")
def test_a_gguf_file_is_served_in_its_block_types(case: tuple, tmp_path: Path) -> None:
    arch, overrides, quant = case
    gguf_file, _ = gguf_of(tiny_checkpoint(arch, **overrides), quant)
    derived = prepare_checkpoint(gguf_file, tmp_path)
    quantized, reference = runner(derived, "auto"), runner(derived, "none")
    # Every matmul and the embedding table are quantized; their float parameters hold nothing.
    expected = set(matrix_shapes(quantized.config))
    assert set(quantized.model.weight_formats) == expected
    params = dict(quantized.model.named_parameters())
    assert all(params[name].numel() == 0 for name in expected)
    # Each part keeps its own type: q and k (one type) packed as one part, v apart if it differs.
    config = quantized.config
    q_k, v = (config.num_heads + config.num_kv_heads) * config.head_dim, config.num_kv_heads
    v *= config.head_dim
    mixed = quantized.model.weight_formats["layers.0.self_attn.qkv_proj.weight"]
    default = quant.split(",")[0]
    if "attn_v=Q8_0" in quant:
        assert mixed.parts == ((default, q_k), ("Q8_0", v))
    else:
        assert mixed.parts == ((default, q_k + v),)
    fused = quantized.model.fused_decode
    assert fused is not None
    packed = fused.quantized["layers.0.self_attn.qkv_proj.weight"]
    assert [(part.format, part.rows) for part in packed.parts] == list(mixed.parts)
    assert_close_to(logits_of(quantized, [PROMPT]), logits_of(reference, [PROMPT]))


@pytest.mark.parametrize("scheme", ["q8_0", "q4_1", "int4"])
def test_a_float_checkpoint_quantizes_at_load(scheme: str) -> None:
    checkpoint = tiny_checkpoint("qwen3")
    quantized = runner(checkpoint, scheme)
    assert set(quantized.model.weight_formats) == set(matrix_shapes(quantized.config))
    # The reference: the float model holding the weights the scheme rounds to (torch's matmuls
    # read the parameters as they are), so what is left is the kernel's own error.
    reference = runner(checkpoint, "none", backend="torch")
    params = dict(reference.model.named_parameters())
    for name in matrix_shapes(reference.config):
        rounded = quantize(params[name].detach().numpy(), scheme).dequantize()
        params[name].data.copy_(torch.from_numpy(rounded))
    assert_close_to(logits_of(quantized, [PROMPT]), logits_of(reference, [PROMPT]))


def test_the_memory_plan_counts_the_packed_codes_and_nothing_else(tmp_path: Path) -> None:
    gguf_file, _ = gguf_of(tiny_checkpoint("llama", tie_word_embeddings=True), "Q4_1")
    model = runner(prepare_checkpoint(gguf_file, tmp_path), "auto")
    floats = sum(p.numel() * p.element_size() for p in model.model.parameters())
    shapes = matrix_shapes(model.config)
    codes = sum(packed_bytes(*shapes[name], "Q4_1") for name in model.model.weight_formats)
    # The float parameters left are the norms only, and the plan is exactly them plus the codes.
    assert floats == sum(p.numel() * 4 for n, p in model.model.named_parameters() if "norm" in n)
    assert model.weight_bytes == floats + codes
    float_plan = placement.resident_weight_bytes(model.config, "float32", 1, "cpu")
    assert model.weight_bytes < float_plan / 4


def test_a_row_does_not_depend_on_its_batch_in_deterministic_mode(tmp_path: Path) -> None:
    gguf_file, _ = gguf_of(tiny_checkpoint("qwen2"), "Q4_1")
    model = runner(prepare_checkpoint(gguf_file, tmp_path), "auto", backend="batch_invariant")
    alone = logits_of(model, [PROMPT])[0]
    batched = logits_of(model, [OTHER, PROMPT, OTHER[::-1]])[1]
    assert torch.equal(alone, batched)


def test_unknown_schemes_and_tensor_parallel_quantization_are_refused() -> None:
    from engine.model.quantized.formats import quantized_formats

    checkpoint = tiny_checkpoint("qwen3")
    config = load_model_config(checkpoint)
    with pytest.raises(ValueError, match="unknown quantization 'q3_x'"):
        quantized_formats(checkpoint, config, "q3_x")
    with pytest.raises(ValueError, match="one rank"):
        quantized_formats(checkpoint, config, "q8_0", tensor_parallel_size=2)
    assert quantized_formats(checkpoint, config, "auto") == {}  # a float checkpoint stays float


def test_the_setting_offers_every_choice_the_loader_takes() -> None:
    from typing import get_args

    from engine.model.quantized.formats import CHOICES
    from engine.settings.schema import Quantization

    assert set(get_args(Quantization)) == set(CHOICES)


FUSED_CASES = [  # (architecture, overrides, GGUF types or None for the float checkpoint, KV)
    *((*case, "auto") for case in GGUF_CASES[1:]),  # quantized: a float16 cache
    ("qwen2", {}, None, "auto"),  # float32 weights: a float32 cache
    ("qwen3", {"num_kv_heads": 1}, None, "int8"),
    ("llama", {}, "Q4_1", "bfloat16"),
]


@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: f"{c[0]}-{c[2] or 'float32'}-kv-{c[3]}")
def test_the_fused_decode_step_equals_the_layers_bit_for_bit(case: tuple, tmp_path: Path) -> None:
    """engine/model/architectures/fused_decode.py runs a decode step's layers in one C++ call:
    biases (qwen2), q/k norms (qwen3), mixed code widths, float32 panels and every KV cache dtype
    give the same logits as the layers one by one."""
    arch, overrides, quant, kv_dtype = case
    if quant is None:
        model = runner(tiny_checkpoint(arch, **overrides), "none", kv_cache_dtype=kv_dtype)
    else:
        gguf_file, _ = gguf_of(tiny_checkpoint(arch, **overrides), quant)
        model = runner(prepare_checkpoint(gguf_file, tmp_path), "auto", kv_cache_dtype=kv_dtype)
    expected = {"auto": torch.float16 if quant else torch.float32}.get(kv_dtype)
    assert model.kv_cache.dtype == (expected or getattr(torch, kv_dtype))
    fused = model.model.fused_decode
    assert fused is not None
    allocator = BlockAllocator(model.num_blocks)
    prompts = [PROMPT, OTHER, PROMPT[::-1]]
    tables = [allocator.allocate(2) for _ in prompts]
    model.forward([SeqChunk(i, p, 0, tables[i], True) for i, p in enumerate(prompts)])
    for position in range(3):  # three decode steps, each run both ways over the same cache
        chunks = [
            SeqChunk(i, [7 + i + position], len(p) + position, tables[i], True)
            for i, p in enumerate(prompts)
        ]
        step = model.prepare(chunks)
        assert step.attention is not None
        assert fused.takes(model.model.embed_tokens(step.token_ids), step.attention)
        model.model.fused_decode = None
        layers = model.forward(chunks)
        model.model.fused_decode = fused
        assert torch.equal(model.forward(chunks), layers)


def test_bfloat16_activations_run_on_quantized_weights() -> None:
    """The kernel takes float32 activations: a bfloat16 model converts around each matmul."""
    checkpoint = tiny_checkpoint("qwen3")
    logits = {}
    for dtype in ("float32", "bfloat16"):
        model = ModelRunner(
            str(checkpoint), dtype=dtype, kv_cache_memory=1 << 20, quantization="q8_0"
        )
        assert model.model.fused_decode is None or dtype == "float32"
        logits[dtype] = logits_of(model, [PROMPT])
    assert float(torch.cosine_similarity(logits["float32"], logits["bfloat16"], dim=-1)) > 0.99


def test_every_scheme_has_a_packed_format() -> None:
    from engine.model.quantized.formats import SCHEME_FORMATS
    from engine.quantization.quantize import SCHEMES

    assert set(SCHEME_FORMATS) == set(SCHEMES)
