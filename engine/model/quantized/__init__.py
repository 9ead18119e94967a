"""Weights served quantized: which ones and in what block format (`formats.py`, torch-free: the
root plans memory with it), and the layers that run matmuls and lookups on their codes."""
