"""The decoder families, one module per family over the shared layers (`layers.py`, `rope.py`,
the `decoder.py` skeleton), and the torch-free registry (`registry.py`) that maps a Hugging
Face `architectures` entry or a GGUF `general.architecture` onto its family."""
