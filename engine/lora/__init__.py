"""LoRA adapters served by name: the root's registry. The adapters' files are read and checked in
engine/model/lora/files.py, applied per token row in engine/model/lora/weights.py."""
