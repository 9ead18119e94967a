"""The Triton kernel backend (backend.py), for GPUs. Importing this package loads nothing."""
