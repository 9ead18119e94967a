"""Model execution on a worker rank, by concern:

- `architectures/`: the decoder families (one module per family over shared layers) and the
  registry that maps a checkpoint's architecture onto its family;
- `loading/`: checkpoint files and names onto a family's parameters, the restart weight store;
- `quantized/`: which weights are served quantized, and the layers that run them;
- `lora/`: LoRA adapters, read and checked (torch-free) and laid out for a step;
- `sampling/`: a step's logits into tokens, logprobs and prompt logprobs;
- `speculation/`: the draft model and the verification of its proposals;
- `placement/`: device, dtype, threads and memory (torch-free rules);
- `parallel/`: tensor parallelism;
- and at the top: the config (`config.py`), the runner, one worker step, its inputs, pooling.

Import the modules themselves: most of them import torch, which only the worker processes may
pay for."""
