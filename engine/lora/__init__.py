"""LoRA adapters in the PEFT format: read and checked (adapter_files), applied per token row
by the decoder (weights)."""
