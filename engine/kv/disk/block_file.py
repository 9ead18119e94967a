"""One KV block on disk: a 64-byte header, then the block's bytes for every tensor-parallel rank.

The header names what the file holds and lets a reader prove it before a byte reaches the cache:

    magic      8 bytes   b"ENGKVB" + format version (u16, little-endian)
    namespace 16 bytes   what the KV depends on besides the tokens (engine/kv/disk/namespace.py)
    key       16 bytes   the block's prefix-cache key (engine/kv/cache/prefix_cache.py)
    length     8 bytes   the payload's bytes (u64)
    checksum   4 bytes   CRC-32 of the namespace, key, length and payload (u32)
    reserved  12 bytes   zero

The payload is rank 0's block, then rank 1's, ..., each in the transfer stream's order
(engine/kv/transfer/cache_view.py: for each layer, K then V). A file that is shorter or longer
than its header says (truncated, torn), whose checksum fails (corrupt), or whose namespace or key
is not the one asked for (another model's, another format's, copied under a wrong name) is never
served. CRC-32 is there for accidents (a torn write, a bad sector), not for an adversary: the
directory is the user's own, mode 0700, and each file is checked to be theirs before it is read.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

FORMAT_VERSION = 1
MAGIC = b"ENGKVB" + struct.pack("<H", FORMAT_VERSION)
KEY_BYTES = 16
HEADER = struct.Struct("<8s16s16sQI12x")
HEADER_BYTES = HEADER.size  # 64
SUFFIX = ".kv"


class BadBlockFile(ValueError):
    """A block file that must not be served; the message says why in a few words."""


def file_name(key: bytes) -> str:
    return key.hex() + SUFFIX


def key_of(name: str) -> bytes | None:
    """The key a block file's name gives, or None for a name that is no block file's."""
    if not name.endswith(SUFFIX) or len(name) != 2 * KEY_BYTES + len(SUFFIX):
        return None
    try:
        return bytes.fromhex(name[: 2 * KEY_BYTES])
    except ValueError:
        return None


def checksum(namespace: bytes, key: bytes, parts: Sequence[memoryview | bytes]) -> int:
    length = sum(len(part) for part in parts)
    crc = zlib.crc32(namespace + key + struct.pack("<Q", length))
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


def header(namespace: bytes, key: bytes, parts: Sequence[memoryview | bytes]) -> bytes:
    """The header of a file holding `parts` (the payload, in pieces) of block `key`."""
    length = sum(len(part) for part in parts)
    return HEADER.pack(MAGIC, namespace, key, length, checksum(namespace, key, parts))


def check(
    head: bytes | bytearray,
    namespace: bytes,
    key: bytes,
    parts: Sequence[memoryview | bytes],
    file_bytes: int,
) -> None:
    """BadBlockFile unless `head` + `parts` (the payload as read) are block `key` of
    `namespace` whole; `file_bytes`: the file's size on disk."""
    payload = sum(len(part) for part in parts)
    if file_bytes < HEADER_BYTES + payload:
        raise BadBlockFile(f"truncated: {file_bytes} bytes, a block takes {HEADER_BYTES + payload}")
    magic, their_namespace, their_key, length, crc = HEADER.unpack(bytes(head[:HEADER_BYTES]))
    if magic != MAGIC:
        raise BadBlockFile(f"not a KV block file of format {FORMAT_VERSION} (magic {magic!r})")
    if their_namespace != namespace:
        raise BadBlockFile("foreign: it holds another model's or format's KV")
    if their_key != key:
        raise BadBlockFile("foreign: it holds another prefix's KV than its name says")
    if length != payload or file_bytes != HEADER_BYTES + payload:
        raise BadBlockFile(f"torn: {file_bytes} bytes, payload {length}, expected {payload}")
    if checksum(namespace, key, parts) != crc:
        raise BadBlockFile("corrupt: its checksum does not match")
