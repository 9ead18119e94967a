"""Model execution: architectures (Llama, Qwen2, Qwen3), loader, runner, sampler, checkpoint
maker and the built-in demo model. Import the modules themselves: most of them import torch,
which only the worker processes may pay for."""
