"""kv_transfer.peers may name networks (a cluster's pod network): a pod's address is not known
before it starts, only the range it comes from. Addresses inside a network are peers, any other
is refused with the usual 400; a malformed network stops the start naming the setting."""

from __future__ import annotations

import pytest

from engine.inflight.kv_params import KvParams
from engine.kv.transfer.signing import sign
from engine.messages.kv_transfer import KvEndpoint, KvSource
from engine.request.outputs import EngineError
from engine.settings import SettingsError, load_settings
from tests.unit.test_kv_security import NOW, SECRET, params_of, source


def signed_from(host: str) -> KvSource:
    return sign(source(endpoints=[KvEndpoint(host, 7100, "pod")]), SECRET, NOW + 60)


def decode_side(*peers: str) -> KvParams:
    return KvParams("decode", SECRET, peers, ttl=60, clock=lambda: NOW)


@pytest.mark.parametrize("host", ["10.244.3.17", "10.244.0.1", "fd00:10:244::5"])
def test_an_address_inside_a_peer_network_is_pulled_from(host: str) -> None:
    signed = signed_from(host)
    decode = decode_side("10.244.0.0/16", "fd00:10:244::/64")
    assert decode.directives(params_of(signed)) == ("", signed)


@pytest.mark.parametrize("host", ["10.245.0.1", "192.168.1.1", "fd00:10:245::5", "pod-a.local"])
def test_an_address_outside_every_peer_network_is_refused(host: str) -> None:
    decode = decode_side("10.244.0.0/16", "fd00:10:244::/64")
    with pytest.raises(EngineError) as refused:
        decode.directives(params_of(signed_from(host)))
    assert refused.value.status == 400
    assert f"at {host}:7100, which is not among this instance's kv_transfer.peers" in (
        refused.value.message
    )


def test_a_malformed_peer_network_stops_the_start_naming_it() -> None:
    with pytest.raises(SettingsError) as bad:
        load_settings(["--kv_transfer.peers", "10.244.0.0/33"], {})
    assert str(bad.value) == (
        "invalid setting kv_transfer.peers (flag): '10.244.0.0/33' is neither a host nor a "
        "network such as 10.244.0.0/16"
    )
    settings, _ = load_settings([], {"ENGINE_KV_TRANSFER__PEERS": '["10.244.0.0/16", "h"]'})
    assert settings.kv_transfer.peers == ("10.244.0.0/16", "h")
