"""A request's `kv_transfer_params` (P/D across instances, as vLLM's proxy sends them): what
they ask of this instance, and the ones it hands out.

- `{"do_remote_decode": true}` to a prefill instance: compute the prompt and one token, then
  hold the prompt's KV for a decode instance; the answer carries the `kv_transfer_params` to
  give that decode instance, signed here (engine/kv/transfer/signing.py) with an expiry.
- those `kv_transfer_params` to a decode instance: pull the prompt's KV from where they say
  instead of computing it (what cannot be pulled is computed). Only parameters a prefill
  instance of this deployment signed, unchanged and unexpired, naming sources among
  kv_transfer.peers, are taken; any other is a 400 before any connection is made.

An instance of role both (colocated) serves the request by itself and ignores them, as an engine
without a KV connector does. They are decoded into typed structs (never unpickled): anything
else is a 400 naming `kv_transfer_params`.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import msgspec

from engine.kv.transfer.secret import instance_secret
from engine.kv.transfer.signing import sign, signature_problem
from engine.messages.kv_transfer import KvEndpoint, KvHandoff, KvSource
from engine.request.outputs import EngineError
from engine.settings import Settings

PARAM = "kv_transfer_params"


class KvParams:
    def __init__(
        self,
        role: str,
        secret: bytes = b"",
        peers: Collection[str] = (),
        ttl: float = 300.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if role != "both" and not secret:
            raise ValueError(f"an instance of role {role} needs the deployment secret")
        self.role = role
        self._secret = secret
        self._peers = frozenset(peers)
        self._networks = peer_networks(peers)
        self._ttl = ttl
        self._clock = clock

    def directives(self, params: Mapping[str, Any] | None) -> tuple[KvHandoff, KvSource | None]:
        """(the handoff mode, the KV source) these params ask of this instance."""
        if not params or self.role == "both":
            return "", None
        if params.get("do_remote_decode"):
            if self.role != "prefill":
                raise _refused(
                    "kv_transfer_params.do_remote_decode asks for a prefill instance; this one "
                    f"was started with --kv-role {self.role}"
                )
            return "hold", None
        if self.role != "decode":
            raise _refused(
                "kv_transfer_params naming a KV source are for a decode instance; this one was "
                "started with --kv-role prefill"
            )
        return "", self._verified(params)

    def signed(self, params: dict[str, Any]) -> dict[str, Any]:
        """The kv_transfer_params of a handoff, as this instance's word (valid for the ttl)."""
        source = msgspec.convert(params, KvSource)
        return msgspec.to_builtins(sign(source, self._secret, self._clock() + self._ttl))  # type: ignore[no-any-return]

    def _verified(self, params: Mapping[str, Any]) -> KvSource:
        try:
            source = msgspec.convert(dict(params), KvSource)
        except msgspec.ValidationError as exc:
            raise _refused(
                f"kv_transfer_params is not a KV source a prefill instance of this engine gave: "
                f"{exc}"
            ) from None
        problem = signature_problem(source, self._secret, self._clock())
        if problem is not None:
            raise _refused(f"kv_transfer_params cannot be used: {problem}")
        for endpoint in source.endpoints:
            if not self._is_peer(endpoint):
                raise _refused(
                    f"kv_transfer_params name a KV source at {endpoint.host}:{endpoint.port}, "
                    "which is not among this instance's kv_transfer.peers"
                )
        return source

    def _is_peer(self, endpoint: KvEndpoint) -> bool:
        host, port = endpoint.host, endpoint.port
        if {host, f"{host}:{port}", f"[{host}]:{port}"} & self._peers:
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in network for network in self._networks)


def peer_networks(
    peers: Collection[str],
) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """The peers written as networks (`10.244.0.0/16`): any address inside one is a peer, as a
    pod's address is only known to lie in its cluster's pod network. A malformed one raises
    ValueError."""
    return tuple(ipaddress.ip_network(peer, strict=False) for peer in peers if "/" in peer)


def instance_kv_params(settings: Settings) -> KvParams:
    """This instance's rules (its role, and for prefill or decode its deployment secret)."""
    kv = settings.kv_transfer
    if kv.role == "both":
        return KvParams("both")
    return KvParams(kv.role, instance_secret(settings), kv.peers, kv.params_ttl)


def _refused(message: str) -> EngineError:
    return EngineError(message, 400, PARAM)
