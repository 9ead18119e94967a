"""LoRA adapters on the model side: an adapter's PEFT files read and checked against the base
model (`files.py`, torch-free), and its tensors laid out for a step's rows (`weights.py`). The
root's registry of adapters is `engine/lora/`."""
