"""A rank's loaded weights kept in one read-only shared-memory segment, for its successors.

Reading a checkpoint is most of a worker's start: a GGUF file's tensors are dequantized or
repacked for the CPU kernel, a safetensors file's converted to the serving dtype. A worker that
dies mid-run is restarted with the same settings, so what its predecessor built is still right:
the first worker of a run writes its final tensors (the float parameters and the packed
quantized weights, exactly as the model uses them) into a segment, and every later start of the
same rank maps it instead of reading the checkpoint. The first worker maps it too, and drops its
own copies, so the segment costs no memory over the weights themselves, and every start runs the
model on the same bytes.

The segment is `weights-<digest of what the weights depend on>` in the run's own directory in
/dev/shm (engine/runtime/shm.py: owner-only, so nobody else can put a file under that name), and
its index names the run (the directory's random token): a segment of any other run is refused,
as is one that is not a regular file of ours with mode 0600. The next start of the engine sweeps
it when a crash left it (its root is dead), and the worker unlinks it when it is stopped in order
(engine/actors/worker.py). It is written under a temporary name and renamed into place whole, so
a writer killed halfway leaves nothing a successor would map. Its index is msgpack of plain
values (never pickle); a successor maps the data copy-on-write, so nothing it does can change
what the next one maps.

Layout: 8 bytes magic, 8 bytes index length, the index (msgpack, `StoreIndex`), then the
tensors, each at a 64-byte aligned offset (the packed kernel's alignment).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import mmap
import os
import struct
from typing import TYPE_CHECKING

import msgspec
import torch

from engine.model.quantized.formats import WeightFormat
from engine.runtime.private_files import create_private, open_private
from engine.runtime.shm_space import shm_free

if TYPE_CHECKING:
    from engine.kernels.cpu.quantized import PackedWeight

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
MAGIC = b"engwts03"
ALIGNMENT = 64
# The store takes at most this share of the free space (less the engine segments' untouched
# claims): what the store takes, nothing else of the run or of other runs can have.
MAX_FREE_SHARE = 0.5
_HEADER = struct.Struct("<8sQ")
_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.uint8)
}


@dataclasses.dataclass
class LoadedWeights:
    """What reading a checkpoint gives a rank: its float parameters by name (the quantized ones
    as their empty placeholders), its packed quantized weights, and their formats."""

    params: dict[str, torch.Tensor]
    packed: dict[str, PackedWeight]
    formats: dict[str, WeightFormat]


class StoredTensor(msgspec.Struct, frozen=True):
    name: str
    dtype: str
    shape: list[int]
    offset: int  # from the start of the segment
    part: str = ""  # a packed quantized weight's part: its format (layout.FORMATS); else ""
    rows: int = 0
    k: int = 0
    origin: str = ""  # PackedPart.source


class StoreIndex(msgspec.Struct, frozen=True):
    run: str  # the run directory's name (its random token): another run's segment is refused
    identity: str  # what the weights were built from, in words: a mismatch is refused
    tensors: list[StoredTensor]
    formats: dict[str, WeightFormat]


class StoreSlot:
    """One rank's weights segment in the run directory `run_dir`: `identity` says, in words,
    what the weights depend on (the checkpoint, dtype, quantization, kernels, tensor-parallel
    rank); its digest names the segment, and a segment holding other weights, or another run's,
    is refused."""

    def __init__(self, run_dir: str, identity: str, directory: str = SHM_DIR) -> None:
        if not run_dir or os.sep in run_dir or run_dir.startswith("."):
            raise ValueError(f"run_dir must be a run directory's name, got {run_dir!r}")
        digest = hashlib.sha256(identity.encode()).hexdigest()[:20]
        self.directory = directory
        self.path = os.path.join(directory, run_dir, f"weights-{digest}")
        self.run = run_dir
        self.identity = identity

    def load(self) -> LoadedWeights | None:
        """The weights a predecessor stored, mapped; None when there are none. ForeignFileError
        for a file that is not ours, ValueError for one that holds other weights."""
        fd = self._open()
        if fd is None:
            return None
        try:
            size = os.fstat(fd).st_size
            # Copy-on-write: pages are shared with every other mapping until written, which the
            # model never does; a stray write would stay this process's own.
            memory = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE)
        finally:
            os.close(fd)
        weights = _read(memory, self.run, self.identity)
        log.info(
            "weights mapped from %s (%.1f MiB): the checkpoint is not read", self.path, size / 2**20
        )
        return weights

    def save(self, weights: LoadedWeights) -> LoadedWeights:
        """Store `weights` for the successors (unless a peer stored the same already) and
        return them mapped from the segment, so the caller can drop its own copies."""
        if not os.path.lexists(self.path):
            size = _stored_bytes(weights)
            free = shm_free(self.directory)
            if size > free * MAX_FREE_SHARE:
                log.warning(
                    "weights not stored for later starts: %.1f MiB would take over half of the "
                    "%.1f MiB free in %s (less the untouched parts of engine segments)",
                    size / 2**20,
                    free / 2**20,
                    self.directory,
                )
                return weights
            try:
                _write(self.path, self.run, self.identity, weights)
            except OSError as exc:  # no room: later starts read the checkpoint again
                log.warning("weights not stored for later starts in %s: %s", self.path, exc)
                return weights
        return self.load() or weights  # None: unlinked meanwhile, keep our own

    def _open(self) -> int | None:
        """A checked descriptor of the stored weights for reading; None when there are none."""
        try:
            return open_private(self.path)
        except FileNotFoundError:
            return None

    def remove(self) -> None:
        """Unlink the segment (mappings stay valid) and what a killed writer left of it."""
        directory, name = os.path.split(self.path)
        with contextlib.suppress(FileNotFoundError):
            entries = os.listdir(directory)
            for entry in entries:
                if entry == name or (entry.startswith(name + ".") and entry.endswith(".tmp")):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(directory, entry))


def _stored_bytes(weights: LoadedWeights) -> int:
    floats = sum(tensor.numel() * tensor.element_size() for tensor in weights.params.values())
    return floats + sum(packed.nbytes for packed in weights.packed.values())


def _write(path: str, run: str, identity: str, weights: LoadedWeights) -> None:
    tensors: list[tuple[StoredTensor, torch.Tensor]] = []
    for name, tensor in weights.params.items():
        tensors.append((_entry(name, tensor), tensor))
    for name, packed in weights.packed.items():
        for part in packed.parts:  # in row order: read back in the same order
            fields = {"part": part.format, "rows": part.rows, "k": part.k, "origin": part.source}
            tensors.append((msgspec.structs.replace(_entry(name, part.data), **fields), part.data))
    index_size = len(_encode_index(run, identity, [entry for entry, _ in tensors], weights.formats))
    # Room for the offsets themselves: msgpack spends up to 8 more bytes on a large integer.
    offset = _aligned(_HEADER.size + index_size + 8 * len(tensors))
    placed: list[tuple[StoredTensor, torch.Tensor]] = []
    for entry, tensor in tensors:
        placed.append((msgspec.structs.replace(entry, offset=offset), tensor))
        offset = _aligned(offset + tensor.numel() * tensor.element_size())
    index = _encode_index(run, identity, [entry for entry, _ in placed], weights.formats)
    temporary = f"{path}.{os.getpid()}.tmp"
    fd = create_private(temporary)
    try:
        # Reserved whole now: a tmpfs without room fails here (ENOSPC), not with a SIGBUS at
        # the first write past its free space.
        os.posix_fallocate(fd, 0, offset)
        with mmap.mmap(fd, offset) as memory:
            memory[: _HEADER.size] = _HEADER.pack(MAGIC, len(index))
            memory[_HEADER.size : _HEADER.size + len(index)] = index
            target = torch.frombuffer(memory, dtype=torch.uint8)
            for entry, tensor in placed:
                flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                target[entry.offset : entry.offset + flat.numel()].copy_(flat)
            del target
        os.rename(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    finally:
        os.close(fd)
    log.info("weights stored for later starts in %s (%.1f MiB)", path, offset / 2**20)


def _read(memory: mmap.mmap, run: str, identity: str) -> LoadedWeights:
    from engine.kernels.cpu.quantized import PackedPart, PackedWeight

    magic, index_size = _HEADER.unpack_from(memory)
    if magic != MAGIC:
        raise ValueError(f"not a weight segment (magic {magic!r})")
    raw = memory[_HEADER.size : _HEADER.size + index_size]
    index = msgspec.msgpack.decode(raw, type=StoreIndex)
    if index.run != run:
        raise ValueError(f"weight segment of another run ({index.run!r}), refused in {run!r}")
    if index.identity != identity:
        raise ValueError(f"weight segment holds {index.identity!r}, expected {identity!r}")
    params: dict[str, torch.Tensor] = {}
    parts: dict[str, list[PackedPart]] = {}
    for entry in index.tensors:
        dtype = _DTYPES[entry.dtype]
        count = 1
        for size in entry.shape:
            count *= size
        if count:
            flat = torch.frombuffer(memory, dtype=dtype, count=count, offset=entry.offset)
        else:
            flat = torch.empty(0, dtype=dtype)
        tensor = flat.view(entry.shape)
        if not entry.part:
            params[entry.name] = tensor
        else:
            part = PackedPart(entry.part, entry.rows, entry.k, tensor, entry.origin)
            parts.setdefault(entry.name, []).append(part)
    packed = {name: PackedWeight(tuple(found)) for name, found in parts.items()}
    return LoadedWeights(params, packed, dict(index.formats))


def _entry(name: str, tensor: torch.Tensor) -> StoredTensor:
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"{name}: cannot store a tensor of {tensor.dtype}")
    return StoredTensor(name=name, dtype=dtype, shape=list(tensor.shape), offset=0)


def _encode_index(
    run: str, identity: str, tensors: list[StoredTensor], formats: dict[str, WeightFormat]
) -> bytes:
    index = StoreIndex(run=run, identity=identity, tensors=tensors, formats=formats)
    return msgspec.msgpack.encode(index)


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT
