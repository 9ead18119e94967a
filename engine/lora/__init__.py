"""LoRA adapters served by name: the root's registry. The adapters' files are read and checked in
engine/model/lora_files.py, applied per token row in engine/model/lora_weights.py."""
