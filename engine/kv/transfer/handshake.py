"""Mutual challenge-response on every kv_transfer connection, before any request is read: each
end proves it holds the deployment secret (secret.py) without sending it.

    puller                                  server
                                         <- Challenge(server nonce)
    Proof(puller nonce, MAC("puller", server nonce, puller nonce)) ->
                                         <- Accepted(MAC("server", puller nonce, server nonce))
                                         <- WireError("refused")   a wrong or missing proof;
                                                                   the server then closes

The server proves itself only to a puller that proved itself first, so a peer without the
secret gets a random nonce and one generic refusal: nothing about the secret, the cache, the
transfers or the host. The puller checks the server's MAC before it names any transfer, so a
listener without the secret learns nothing either, and its blocks are never taken. Fresh
nonces on both sides make a recorded exchange worthless; the role in each MAC makes one side's
MAC useless as the other's. Before the handshake, frames are limited to HANDSHAKE_FRAME_BYTES.

This authenticates the peers, not the bytes that follow: on a network an attacker could take
over, run it inside TLS (tls.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import socket
import time

from engine.kv.transfer.wire import ConnectionEnded, Framer, ProtocolError
from engine.messages.kv_wire import Accepted, Challenge, HandshakeToPuller, Proof, WireError

NONCE_BYTES = 32
HANDSHAKE_TIMEOUT = 5.0  # how long a server waits for a proof (an unproven peer holds a thread)
HANDSHAKE_FRAME_BYTES = 256
REFUSAL = "refused"  # all a peer without the secret is ever told

_DOMAIN = b"engine kv_transfer handshake v1\0"
_TO_SERVER = Framer(Proof, HANDSHAKE_FRAME_BYTES)
_TO_PULLER = Framer(HandshakeToPuller, HANDSHAKE_FRAME_BYTES)


class HandshakeFailed(Exception):
    """The server did not prove the deployment secret, or refused this puller's proof."""


def admit_puller(sock: socket.socket, secret: bytes) -> bool:
    """Server side: True once the peer proved the secret (it has been told so); else it got
    the generic refusal and the caller closes the connection."""
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT
    nonce = secrets.token_bytes(NONCE_BYTES)
    try:
        _TO_PULLER.send(sock, Challenge(nonce), deadline)
        proof = _TO_SERVER.receive(sock, deadline)
    except (ProtocolError, ConnectionEnded, OSError):  # TimeoutError is an OSError
        proof = None
    if proof is None or not _valid(proof, nonce, secret):
        with contextlib.suppress(ProtocolError, OSError):
            _TO_PULLER.send(sock, WireError(REFUSAL), deadline)
        return False
    _TO_PULLER.send(sock, Accepted(_mac(secret, b"server", proof.nonce, nonce)), deadline)
    return True


def prove_to_server(sock: socket.socket, secret: bytes, deadline: float) -> None:
    """Puller side; HandshakeFailed unless both ends proved the secret."""
    challenge = _TO_PULLER.receive(sock, deadline)
    if not isinstance(challenge, Challenge) or len(challenge.nonce) != NONCE_BYTES:
        opened = type(challenge).__name__
        raise HandshakeFailed(f"the source opened with a {opened}, not a challenge")
    nonce = secrets.token_bytes(NONCE_BYTES)
    _TO_SERVER.send(sock, Proof(nonce, _mac(secret, b"puller", challenge.nonce, nonce)), deadline)
    reply = _TO_PULLER.receive(sock, deadline)
    if isinstance(reply, WireError):
        raise HandshakeFailed(
            "the source refused this instance's proof of the deployment secret (every instance "
            "of a deployment needs the same kv_transfer secret)"
        )
    expected = _mac(secret, b"server", nonce, challenge.nonce)
    if not isinstance(reply, Accepted) or not hmac.compare_digest(reply.mac, expected):
        raise HandshakeFailed("the source did not prove the deployment secret")


def _valid(proof: Proof, nonce: bytes, secret: bytes) -> bool:
    if len(proof.nonce) != NONCE_BYTES:
        return False
    return hmac.compare_digest(proof.mac, _mac(secret, b"puller", nonce, proof.nonce))


def _mac(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, _DOMAIN + role + b"\0" + first + second, hashlib.sha256).digest()
