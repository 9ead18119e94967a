"""Weights that stay quantized: a GGUF file's block types (and float checkpoints quantized at
load) as integer codes with a scale and a minimum per block of 32 values (`codes.py`), packed once
into the layout the CPU kernels stream through (`layout.py`, engine/kernels/cpu/quantized.py)."""
