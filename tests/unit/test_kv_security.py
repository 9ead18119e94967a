"""The pieces of KV transfer security that need no process: the deployment secret's sources,
signed kv_transfer_params (what a decode instance refuses, with a 400 naming them), the
handshake over a real socket pair, and the refusal log's rate."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import stat
import struct
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from engine.inflight.kv_params import KvParams
from engine.kv.transfer.handshake import HandshakeFailed, admit_puller, prove_to_server
from engine.kv.transfer.refusals import RefusalLog
from engine.kv.transfer.secret import SECRET_ENV, SecretError, deployment_secret
from engine.kv.transfer.signing import sign, signature_problem
from engine.messages.kv_transfer import KvEndpoint, KvSource
from engine.messages.kv_wire import Accepted, Challenge
from engine.request.outputs import EngineError
from tests.unit.test_kv_cache_view import layout

SECRET = secrets.token_bytes(32)
NOW = 1_000_000.0


def source(**fields: Any) -> KvSource:
    endpoint = KvEndpoint("127.0.0.1", 7100, "host")
    defaults: dict[str, Any] = {
        "transfer_id": secrets.token_hex(16),
        "endpoints": [endpoint],
        "block_ids": [3, 4],
        "num_tokens": 8,
        "layout": layout(16),
        "prompt_key": "ab" * 16,
    }
    return KvSource(**{**defaults, **fields})


def params_of(kv_source: KvSource) -> dict[str, Any]:
    return msgspec.to_builtins(kv_source)  # type: ignore[no-any-return]


def decode_side(secret: bytes = SECRET, peers: tuple[str, ...] = ("127.0.0.1",)) -> KvParams:
    return KvParams("decode", secret, peers, ttl=60, clock=lambda: NOW)


def test_a_signed_source_passes_unchanged_and_any_change_breaks_it() -> None:
    signed = sign(source(), SECRET, expires_at=NOW + 60)
    assert signature_problem(signed, SECRET, NOW) is None
    assert decode_side().directives(params_of(signed)) == ("", signed)

    changes = {
        "transfer_id": secrets.token_hex(16),
        "endpoints": [KvEndpoint("127.0.0.1", 7101, "host")],
        "block_ids": [3, 5],
        "num_tokens": 16,
        "prompt_key": "cd" * 16,
        "expires_at": NOW + 3600,
    }
    for field, value in changes.items():
        altered = msgspec.structs.replace(signed, **{field: value})
        assert "does not match" in (signature_problem(altered, SECRET, NOW) or ""), field
    assert "does not match" in (signature_problem(signed, secrets.token_bytes(32), NOW) or "")
    assert "expired 5 s ago" in (signature_problem(signed, SECRET, NOW + 65) or "")
    assert "not signed" in (signature_problem(source(), SECRET, NOW) or "")


@pytest.mark.parametrize(
    ("params", "says"),
    [
        (params_of(source()), "it is not signed"),
        ({**params_of(sign(source(), SECRET, NOW + 60)), "block_ids": [9]}, "does not match"),
        (params_of(sign(source(), SECRET, NOW - 1)), "it expired 1 s ago"),
        (params_of(sign(source(), b"x" * 32, NOW + 60)), "does not match"),
        ({**params_of(sign(source(), SECRET, NOW + 60)), "extra": 1}, "not a KV source"),
        (
            params_of(sign(source(endpoints=[KvEndpoint("10.1.2.3", 7100, "h")]), SECRET, NOW + 9)),
            "at 10.1.2.3:7100, which is not among this instance's kv_transfer.peers",
        ),
    ],
    ids=["unsigned", "altered", "expired", "other-secret", "extra-field", "not-a-peer"],
)
def test_a_decode_instance_refuses_params_it_cannot_trust_with_a_400(
    params: dict[str, Any], says: str
) -> None:
    with pytest.raises(EngineError) as refused:
        decode_side().directives(params)
    assert refused.value.status == 400 and refused.value.param == "kv_transfer_params"
    assert says in refused.value.message
    assert SECRET.hex() not in refused.value.message


def test_peers_name_a_host_or_a_host_and_port() -> None:
    signed = sign(source(endpoints=[KvEndpoint("10.0.0.5", 7100, "h")]), SECRET, NOW + 60)
    for peers in (("10.0.0.5",), ("10.0.0.5:7100",)):
        assert decode_side(peers=peers).directives(params_of(signed))[1] == signed
    with pytest.raises(EngineError, match="not among"):
        decode_side(peers=("10.0.0.5:7101",)).directives(params_of(signed))


def test_a_prefill_instance_signs_what_it_hands_out_for_its_ttl() -> None:
    prefill = KvParams("prefill", SECRET, ttl=42, clock=lambda: NOW)
    signed = prefill.signed(params_of(source()))
    assert signed["expires_at"] == NOW + 42 and len(signed["signature"]) == 64
    assert decode_side().directives(signed)[1] == msgspec.convert(signed, KvSource)


def test_the_secret_comes_from_the_environment_a_file_or_a_created_owner_only_file(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    value = secrets.token_hex(16)
    env = {SECRET_ENV: value}
    assert deployment_secret(one_launch=False, secret_file=None, home=home, environ=env) == (
        value.encode()
    )
    given = tmp_path / "given"
    given.write_text(value + "\n")
    assert deployment_secret(one_launch=False, secret_file=str(given), home=home, environ={}) == (
        value.encode()
    )
    made = deployment_secret(one_launch=False, secret_file=None, home=home, environ={})
    path = home / "kv_transfer.secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(made) == 64
    assert deployment_secret(one_launch=False, secret_file=None, home=home, environ={}) == made
    assert os.listdir(home) == ["kv_transfer.secret"]  # no draft left behind
    run = deployment_secret(one_launch=True, secret_file=str(given), home=home, environ=env)
    assert run not in (made, value.encode()) and len(run) == 32


@pytest.mark.parametrize(
    ("env", "file_text", "says"),
    [
        ({SECRET_ENV: "short"}, None, f"{SECRET_ENV} holds 5 bytes; a deployment secret takes"),
        ({SECRET_ENV: "a" * 32}, "b" * 32, "both ENGINE_KV_SECRET and kv_transfer.secret_file"),
        ({}, "tiny\n", "kv_transfer.secret_file"),
    ],
)
def test_an_unusable_secret_is_an_error_naming_its_source(
    tmp_path: Path, env: dict[str, str], file_text: str | None, says: str
) -> None:
    secret_file = None
    if file_text is not None:
        secret_file = str(tmp_path / "secret")
        Path(secret_file).write_text(file_text)
    with pytest.raises(SecretError, match=says) as raised:
        deployment_secret(one_launch=False, secret_file=secret_file, home=tmp_path, environ=env)
    assert "a" * 32 not in str(raised.value) and "tiny" not in str(raised.value)


def handshake(server_secret: bytes, puller_secret: bytes) -> tuple[bool, str | None]:
    """Both sides of a handshake on a socket pair: (server admitted, puller's error)."""
    server_end, puller_end = socket.socketpair()
    admitted: list[bool] = []

    def serve() -> None:
        admitted.append(admit_puller(server_end, server_secret))

    thread = threading.Thread(target=serve)
    thread.start()
    error = None
    try:
        prove_to_server(puller_end, puller_secret, time.monotonic() + 10)
    except HandshakeFailed as exc:
        error = str(exc)
    thread.join(10)
    server_end.close()
    puller_end.close()
    return admitted[0], error


def test_the_handshake_admits_only_a_puller_with_the_secret() -> None:
    assert handshake(SECRET, SECRET) == (True, None)
    admitted, error = handshake(SECRET, secrets.token_bytes(32))
    assert not admitted and error is not None and "refused this instance's proof" in error


def test_a_puller_names_nothing_to_a_server_that_cannot_prove_the_secret() -> None:
    """A fake server that accepts any proof and answers with a made-up MAC."""
    server_end, puller_end = socket.socketpair()
    deadline = time.monotonic() + 10
    heard: list[bytes] = []

    def fake_server() -> None:
        send_frame(server_end, Challenge(secrets.token_bytes(32)))
        heard.append(server_end.recv(4096))  # the proof
        send_frame(server_end, Accepted(bytes(32)))
        server_end.settimeout(0.5)
        with contextlib.suppress(OSError):
            heard.append(server_end.recv(4096))  # anything after it: nothing, or EOF

    thread = threading.Thread(target=fake_server)
    thread.start()
    with pytest.raises(HandshakeFailed, match="did not prove the deployment secret"):
        prove_to_server(puller_end, SECRET, deadline)
    puller_end.close()
    thread.join(10)
    server_end.close()
    assert heard[1:] in ([], [b""])  # no request followed the proof


def send_frame(sock: socket.socket, message: msgspec.Struct) -> None:
    payload = msgspec.msgpack.encode(message)
    sock.sendall(struct.pack(">I", len(payload)) + payload)


def test_refusals_are_logged_once_per_peer_per_interval_with_the_count() -> None:
    log = RefusalLog(interval=60)
    assert log.note("10.0.0.1", 0.0) == 1
    assert [log.note("10.0.0.1", t) for t in (1.0, 2.0, 59.0)] == [None, None, None]
    assert log.note("10.0.0.2", 3.0) == 1
    assert log.note("10.0.0.1", 60.0) == 4  # this one and the three held back
