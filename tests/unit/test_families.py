"""Every decoder family against Hugging Face transformers on tiny random checkpoints made by
transformers' own config and model classes: greedy tokens of a batch of mixed-length prompts
with chunked prefill (near-tie rule: tests/hf_reference.py), and a prefill's logits within
LOGIT_BOUND of transformers' (float32; the families measure 4e-6 to 1e-5).

The shapes cover what each family adds: windows shorter than the prompts, GQA, MHA and odd head
counts, tied and untied heads, partial rotary and longrope (Phi-3), soft-capping and sandwich
norms (Gemma 2), q/k norms and two rope bases (Gemma 3), more experts than top-k, renormalised
or not. And the same checkpoints as GGUF files (tests/family_gguf.py) load as the same weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.gguf.checkpoint import prepare_checkpoint
from engine.launch.plan import plan_engine
from engine.library.llm import build_settings
from engine.messages.params import LoRARequest
from engine.model.runner import ModelRunner
from engine.model.step_inputs import SeqChunk
from tests.checkpoints import greedy_generate, tiny_checkpoint
from tests.family_gguf import family_gguf
from tests.hf_reference import assert_greedy_matches_hf, hf_logits, hf_model
from tests.lora_adapters import ALL_MODULES, lora_adapter, peft_logits

LOGIT_BOUND = 1e-4
NEW_TOKENS = 6
LONG = [1, 6, 17, 40]  # past every window below


def _longrope(rotary_dim: int) -> dict[str, Any]:
    half = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [2.0 + 0.5 * i for i in range(half)],
        "original_max_position_embeddings": 32,
    }


# name -> (checkpoint spec, ModelRunner arguments, prompt lengths)
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any], list[int]]] = {
    "mistral-window-gqa-tied": (
        {"arch": "mistral", "tie_word_embeddings": True, "extra": {"sliding_window": 7}},
        {},
        LONG,
    ),
    "ministral-alternating-window-untied": (
        {
            "arch": "ministral",
            "extra": {
                "sliding_window": 5,
                "layer_types": ["sliding_attention", "full_attention"],
            },
        },
        {},
        LONG,
    ),
    "phi3-partial-rotary-window-mha": (
        {
            "arch": "phi3",
            "num_kv_heads": 4,
            "extra": {"partial_rotary_factor": 0.5, "sliding_window": 9},
        },
        {},
        LONG,
    ),
    "phi3-longrope-long-factors": (
        {
            "arch": "phi3",
            "max_position_embeddings": 128,
            "extra": {"original_max_position_embeddings": 32, "rope_parameters": _longrope(16)},
        },
        {},
        [40, 45],  # past the original context: transformers takes the long factors too
    ),
    "phi3-longrope-short-factors": (
        {
            "arch": "phi3",
            "max_position_embeddings": 128,
            "extra": {"original_max_position_embeddings": 32, "rope_parameters": _longrope(16)},
        },
        {"max_model_len": 32},
        [1, 6, 17],
    ),
    "gemma2-softcaps-window-odd-heads": (
        {
            "arch": "gemma2",
            "tie_word_embeddings": True,  # llama.cpp's Gemma 2 always ties
            "head_dim": 16,
            "num_heads": 3,
            "num_kv_heads": 1,
            "hidden_size": 48,
            "extra": {
                "sliding_window": 6,
                "query_pre_attn_scalar": 16,
                "attn_logit_softcapping": 5.0,
                "final_logit_softcapping": 3.0,
            },
        },
        {},
        LONG,
    ),
    "gemma3-qk-norms-two-rope-bases": (
        {
            "arch": "gemma3",
            "head_dim": 16,
            "num_layers": 6,  # layers 0-4 sliding, 5 global: Gemma 3's own pattern
            "extra": {
                "sliding_window": 6,
                "query_pre_attn_scalar": 16,
                "rope_parameters": {
                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                },
            },
        },
        {},
        LONG,
    ),
    "qwen3-moe-renormalised": (
        {
            "arch": "qwen3_moe",
            "extra": {
                "num_experts": 6,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "norm_topk_prob": True,
            },
        },
        {},
        LONG,
    ),
    "olmoe-whole-qk-norms-mha": (
        {"arch": "olmoe", "num_kv_heads": 4, "extra": {"num_experts": 6, "num_experts_per_tok": 3}},
        {},
        LONG,
    ),
    "mixtral-tied": (
        {
            "arch": "mixtral",
            "tie_word_embeddings": True,
            "extra": {"num_local_experts": 5, "num_experts_per_tok": 2},
        },
        {},
        LONG,
    ),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def family(request: pytest.FixtureRequest) -> tuple[Path, ModelRunner, list[int]]:
    spec, runner_args, lengths = VARIANTS[request.param]
    path = tiny_checkpoint(**spec)
    runner = ModelRunner(str(path), kv_cache_memory=4 << 20, block_size=4, **runner_args)
    return path, runner, lengths


def test_greedy_tokens_logits_and_hidden_states_match_transformers(
    family: tuple[Path, ModelRunner, list[int]],
) -> None:
    """Greedy tokens, then one prefill's logits at every row (what speculative decoding's
    verification and prompt logprobs read) and its final-normed hidden states (what embeddings
    pool) against transformers' logits and last_hidden_state."""
    path, runner, lengths = family
    generator = torch.Generator().manual_seed(len(lengths))
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in lengths]
    generated = greedy_generate(runner, prompts, NEW_TOKENS, chunk_size=5)
    for prompt, tokens in zip(prompts, generated, strict=True):
        assert_greedy_matches_hf(path, prompt, tokens)
    sequence = prompts[-1] + generated[-1]
    table = list(range(-(-len(sequence) // runner.block_size)))
    step = runner.prepare([SeqChunk(0, sequence, 0, table, True)], every_row={0})
    ours, hidden = runner.execute_pooled(step, range(len(sequence)))
    assert float((ours - hf_logits(path, sequence)).abs().max()) < LOGIT_BOUND
    with torch.inference_mode():
        theirs = hf_model(str(path)).model(torch.tensor([sequence])).last_hidden_state[0]
    assert hidden is not None
    assert float((hidden - theirs.float()).abs().max()) < LOGIT_BOUND


@pytest.mark.parametrize(
    ("variant", "setting", "refusal"),
    [
        ("mixtral-tied", "parallel.tensor_parallel_size", "with tensor parallelism"),
        ("phi3-longrope-short-factors", "lora.enable_lora", "with LoRA adapters"),
    ],
)
def test_a_combination_a_family_lacks_is_refused_at_start_naming_both(
    variant: str, setting: str, refusal: str
) -> None:
    path = tiny_checkpoint(**VARIANTS[variant][0])
    value = 2 if setting.startswith("parallel.") else True
    with pytest.raises(ValueError, match=f"ForCausalLM {refusal}.*not supported yet"):
        plan_engine(build_settings(**{setting: value}), str(path))


# The families' GGUF files as llama.cpp's converter writes them (tests/family_gguf.py), in types
# their 64-wide rows hold. Mistral's window is not in its GGUF file (llama.cpp's converter reads
# it as a llama model): the llama family's GGUF files are tests/unit/test_gguf_model.py's.
GGUF_CASES = {
    "gemma2-softcaps-window-odd-heads": "F16",  # 48-wide rows: no 32-value blocks
    "gemma3-qk-norms-two-rope-bases": "F16",
    "phi3-partial-rotary-window-mha": "Q4_0",
    "phi3-longrope-long-factors": "F32",
    "qwen3-moe-renormalised": "Q8_0",
    "olmoe-whole-qk-norms-mha": "Q4_1",
    "mixtral-tied": "F16",
}


@pytest.mark.parametrize("variant", sorted(GGUF_CASES))
def test_a_gguf_file_loads_as_its_weights_from_safetensors(variant: str, tmp_path: Path) -> None:
    """Its config read from the file's metadata, its tensors from llama.cpp's names (stacked
    experts, Gemma's 1 + w norms, Phi-3's fused tensors and rope factors): the same logits as
    the same weights after the same quantization loaded from safetensors."""
    spec, runner_args, lengths = VARIANTS[variant]
    gguf_file, reference = family_gguf(tiny_checkpoint(**spec), GGUF_CASES[variant])
    prompt = torch.randint(3, 512, (lengths[-1],), generator=torch.Generator().manual_seed(3))
    chunk = [SeqChunk(0, prompt.tolist(), 0, list(range(-(-lengths[-1] // 4))), True)]
    logits = [
        ModelRunner(
            str(path), kv_cache_memory=1 << 20, block_size=4, quantization="none", **runner_args
        ).forward(chunk)
        for path in (prepare_checkpoint(gguf_file, tmp_path), reference)
    ]
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("variant", [v for v in sorted(GGUF_CASES) if "moe" in v or "mixtral" in v])
def test_a_moe_files_experts_are_served_in_their_block_types(variant: str, tmp_path: Path) -> None:
    """Each layer's stacked experts stay in the file's block type, each expert read where its
    rows lie in the packed weight: on the same routes, a layer's output stays within the
    kernel's int8-activation error of the dequantized experts' (0.5 % of the largest output
    per matmul: tests/unit/test_quantized_model.py). Whole models are not compared: the router
    of a random tiny model flips a token's expert on such an error."""
    spec, runner_args, _ = VARIANTS[variant]
    gguf_file, _ = family_gguf(tiny_checkpoint(**spec), "Q8_0")
    derived = str(prepare_checkpoint(gguf_file, tmp_path))
    served, dequantized = (
        ModelRunner(derived, kv_cache_memory=1 << 20, block_size=4, quantization=q, **runner_args)
        for q in ("auto", "none")
    )
    formats = served.model.weight_formats
    assert {"layers.0.mlp.experts.gate_up", "layers.0.mlp.experts.down"} <= set(formats)
    for layer in range(served.config.num_layers):
        packed, floats = served.model.layers[layer].mlp, dequantized.model.layers[layer].mlp
        assert packed.experts.gate_up.numel() == 0  # no float copy kept
        x = torch.randn(
            9, served.config.hidden_size, generator=torch.Generator().manual_seed(layer)
        )
        routes = packed.route(x)
        packed.route = floats.route = lambda _x, routes=routes: routes
        quantized, reference = packed(x), floats(x)
        assert float((quantized - reference).abs().max()) <= 0.02 * float(reference.abs().max())
        assert float(torch.cosine_similarity(quantized, reference, dim=-1).min()) > 0.999


@pytest.mark.parametrize("variant", ["gemma2-softcaps-window-odd-heads", "qwen3-moe-renormalised"])
def test_deterministic_mode_gives_a_token_the_same_bits_alone_or_in_a_batch(variant: str) -> None:
    """The batch-invariant kernels with windows, soft-caps and routed experts (each expert's
    matmul over however many tokens picked it): the prompt's last token prefilled alone and
    decoded beside a short and a long prefill get the same logits, bit for bit."""
    spec, runner_args, _ = VARIANTS[variant]
    runner = ModelRunner(
        str(tiny_checkpoint(**spec)),
        kv_cache_memory=4 << 20,
        block_size=4,
        kernel_backend="batch_invariant",
        **runner_args,
    )
    generator = torch.Generator().manual_seed(0)
    prompt, short, long = (
        torch.randint(3, 512, (n,), generator=generator).tolist() for n in (30, 5, 17)
    )
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(4)]
    alone = runner.forward([SeqChunk(0, prompt, 0, tables[0], True)])[0]
    runner.forward([SeqChunk(1, prompt[:-1], 0, tables[1], False)])
    beside = runner.forward(
        [
            SeqChunk(2, short, 0, tables[2], True),
            SeqChunk(1, prompt[-1:], len(prompt) - 1, tables[1], True),
            SeqChunk(3, long, 0, tables[3], True),
        ]
    )[1]
    assert torch.equal(alone, beside)


def test_a_lora_adapter_on_gemma_matches_peft() -> None:
    """PEFT's module names (q/k/v/o, gate/up/down) are Gemma's too: an adapter on every
    projection gives peft + transformers' logits (within LOGIT_BOUND)."""
    spec, runner_args, _ = VARIANTS["gemma2-softcaps-window-odd-heads"]
    base = tiny_checkpoint(**spec)
    adapter = lora_adapter(base, rank=8, targets=ALL_MODULES, seed=1)
    runner = ModelRunner(
        str(base), kv_cache_memory=1 << 20, block_size=4, max_lora_rank=8, **runner_args
    )
    prompt = [5, 17, 42, 99, 3, 250, 7, 11, 12, 13]
    lora = LoRARequest("wide", 1, str(adapter))
    ours = runner.forward([SeqChunk(0, prompt, 0, [0, 1, 2], True, lora=lora)])[0]
    assert float((ours - peft_logits(base, adapter, prompt)[-1]).abs().max()) < LOGIT_BOUND
