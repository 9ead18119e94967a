"""From a checkpoint (safetensors or GGUF) to a family's parameters: the loader, the names that
map checkpoint tensors onto fused parameters (torch-free), and the shared-memory store that
hands a rank's loaded weights to its successor after a restart."""
