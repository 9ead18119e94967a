"""What a family cannot combine with yet, refused at start in one line that names both
(torch-free: the root checks before any worker starts)."""

from __future__ import annotations

from engine.model.config import ModelConfig


def unsupported_combination(
    config: ModelConfig, *, tensor_parallel_size: int = 1, lora: bool = False, kernels: str = "auto"
) -> str | None:
    """Why this model cannot run with these settings, in one line; None when it can."""
    model = config.architecture
    if tensor_parallel_size > 1:
        if config.num_experts:
            return f"{model} with tensor parallelism: expert parallelism is not written yet"
        if config.fused_checkpoint:
            return f"{model} with tensor parallelism: its fused q|k|v and gate|up are not split"
        if config.qk_norm_whole:
            return f"{model} with tensor parallelism: its q/k norms span every head"
    if lora and (config.num_experts or config.fused_checkpoint):
        return f"{model} with LoRA adapters: PEFT's module names for it are not mapped yet"
    variants = config.sliding_window is not None or config.attn_logit_softcapping is not None
    if kernels == "triton" and variants:  # the default on a GPU
        return f"{model} with kernel backend 'triton': no sliding window or soft-capping there"
    return None


def check_combination(
    config: ModelConfig, *, tensor_parallel_size: int = 1, lora: bool = False, kernels: str = "auto"
) -> None:
    reason = unsupported_combination(
        config, tensor_parallel_size=tensor_parallel_size, lora=lora, kernels=kernels
    )
    if reason is not None:
        raise ValueError(f"{reason}; not supported yet")
