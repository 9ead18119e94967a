"""Tensor parallelism: how a model splits over ranks (layout, torch-free), the ranks' process
group and its collectives (group), the parallel layers (layers), which part of each checkpoint
tensor a rank loads (sharding), and what a rank is told to join (config, torch-free)."""
