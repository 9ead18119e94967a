"""What a KV block on disk depends on besides its tokens, as one 16-byte namespace.

A block's prefix-cache key names its tokens and everything before them, the LoRA adapter, the
tenant's cache scope and the request's cache_salt (all in the hash chain: kv_salt in
engine/scheduler/requests.py), so a tenant never reads another's blocks from disk either.
The KV it holds also depends on the model's weights, how they are computed (dtype, quantization,
kernels, and the engine's version, whose code computes them), the cache's format (KV dtype and
the bytes of a row's scales after its codes, block size) and how it is split between ranks. All
of that goes into the namespace: a block from another model, format, version or split is never
found, since it lies in another namespace's directory, and is never served, since its header
names its own.

The model is named by its files, not their content (hashing a checkpoint of many GB at every
start would cost more than the tier saves): each weight file's resolved path, size and
modification time, and config.json's bytes. A model changed in place gets a new namespace; one
copied elsewhere starts its tier afresh.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from engine.messages.kv_transfer import KvLayout

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
NAMESPACE_BYTES = 16


def model_digest(model_path: str | Path) -> str:
    """A digest of the checkpoint at `model_path`: its config and its weight files' identities."""
    directory = Path(model_path)
    digest = hashlib.sha256()
    config = directory / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    files = [directory] if directory.is_file() else sorted(directory.iterdir())
    for path in files:
        if path.suffix not in WEIGHT_SUFFIXES:
            continue
        resolved = path.resolve()
        info = resolved.stat()
        digest.update(f"\0{path.name}\0{resolved}\0{info.st_size}\0{info.st_mtime_ns}".encode())
    return digest.hexdigest()[:32]


def describe(
    model: str,
    dtype: str,
    quantization: str,
    kernels: str,
    layouts: Sequence[KvLayout],
) -> str:
    """Everything the KV of one block depends on besides its tokens, in words (`model`: the
    model's digest; `layouts`: each rank's cache, whose block counts do not matter)."""
    first = layouts[0]
    ranks = ",".join(str(layout.num_kv_heads) for layout in layouts)
    return (
        f"engine={engine_version()} model={model} shape={first.model} dtype={dtype} "
        f"quantization={quantization} kernels={kernels} kv_dtype={first.dtype} "
        f"kv_scale_bytes={first.scale_bytes} block_size={first.block_size} "
        f"tp={first.tp_size} kv_heads_by_rank={ranks} layers={first.num_layers} "
        f"head_dim={first.head_dim}"
    )


def engine_version() -> str:
    try:
        return version("engine")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def namespace_of(description: str) -> bytes:
    return hashlib.blake2b(description.encode(), digest_size=NAMESPACE_BYTES).digest()
