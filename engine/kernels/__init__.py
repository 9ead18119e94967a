"""Kernels for attention, norms, rotary embeddings and matmuls, grouped in backends.

The model calls only the functions bundled in a `KernelBackend` (backend.py); registry.py picks
one for a device. Importing this package loads nothing: the CPU kernels' build script
(cpu/build.py) and torch-free tools import submodules without paying for torch.
"""
