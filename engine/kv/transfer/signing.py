"""kv_transfer_params as the prefill instance's word: it signs the KvSource it hands out
(HMAC-SHA256 with the deployment secret over the whole object, its expiry included), and a
decode instance pulls only from a source whose signature it can check. A client carries the
object between the two; changing any field of it (an endpoint, a block id, the expiry) breaks
the signature.

What is signed is the source's msgpack encoding with an empty `signature`: fields in their
declared order, so both ends encode the same object to the same bytes.
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

from engine.messages.kv_transfer import KvSource

_DOMAIN = b"engine kv_transfer_params v1\0"  # a MAC here is never valid in the handshake
_ENCODER = msgspec.msgpack.Encoder()


def sign(source: KvSource, secret: bytes, expires_at: float) -> KvSource:
    unsigned = msgspec.structs.replace(source, expires_at=expires_at, signature="")
    return msgspec.structs.replace(unsigned, signature=_mac(unsigned, secret))


def signature_problem(source: KvSource, secret: bytes, now: float) -> str | None:
    """Why a decode instance must not use `source`, or None. Says nothing of what a right
    signature would be."""
    if not source.signature:
        return "it is not signed (only a prefill instance's answer carries usable ones)"
    expected = _mac(msgspec.structs.replace(source, signature=""), secret)
    if not hmac.compare_digest(source.signature.encode(), expected.encode()):
        return (
            "its signature does not match: it was changed after the prefill instance signed it, "
            "or signed with another deployment secret"
        )
    if source.expires_at <= now:
        return f"it expired {now - source.expires_at:.0f} s ago"
    return None


def _mac(unsigned: KvSource, secret: bytes) -> str:
    return hmac.new(secret, _DOMAIN + _ENCODER.encode(unsigned), hashlib.sha256).hexdigest()
