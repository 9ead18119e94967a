"""P/D across instances at the library level: a --kv-role prefill engine and a --kv-role decode
engine, each with its own supervisor and kv_transfer actor, in one process (what `engine proxy`
does over HTTP, minus HTTP: tests/e2e/test_pd_proxy.py covers that).

The prefill engine computes a prompt and one token and answers with the kv_transfer_params;
the decode engine, given them, pulls the prompt's KV and continues: greedy output equals
transformers'. Bad transfers the deployment itself signed (an unknown or expired transfer id, a
layout that does not match) make the decode engine compute the prompt itself, with the same
output, and it keeps serving; malformed kv_transfer_params are a 400 naming them, and so are
forged, altered and expired ones, before any connection is made.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from engine import AsyncLLM, SamplingParams
from engine.kv.transfer.host import host_id
from engine.kv.transfer.secret import instance_secret
from engine.kv.transfer.signing import sign
from engine.library.llm import build_settings
from engine.messages.kv_transfer import KvSource
from engine.messages.kv_wire import Challenge, PullRequest, WireError
from engine.request.outputs import EngineError
from tests.checkpoints import tiny_checkpoint
from tests.hf_reference import assert_greedy_matches_hf
from tests.integration.test_kv_transfer_security import everything_said

pytestmark = pytest.mark.asyncio(loop_scope="module")

WAIT_S = 120.0
HOLD_TIMEOUT_S = 3.0
PROMPT = [3 + (7 * i) % 190 for i in range(50)]  # three full blocks of 16 and a partial one
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@dataclass
class Pair:
    path: str
    prefill: AsyncLLM
    decode: AsyncLLM


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair() -> AsyncIterator[Pair]:
    path = str(tiny_checkpoint(arch="qwen2"))

    def engine(role: str) -> AsyncLLM:
        return AsyncLLM(
            build_settings(
                **{
                    "model.path": path,
                    "cache.kv_cache_memory": 2 * 2**20,
                    "kv_transfer.role": role,
                    "kv_transfer.hold_timeout": HOLD_TIMEOUT_S,
                }
            )
        )

    prefill, decode = engine("prefill"), engine("decode")
    try:
        await asyncio.wait_for(asyncio.gather(prefill.start(), decode.start()), WAIT_S)
        yield Pair(path, prefill, decode)
    finally:
        await asyncio.gather(
            asyncio.wait_for(prefill.shutdown(), WAIT_S),
            asyncio.wait_for(decode.shutdown(), WAIT_S),
        )


async def complete(
    engine: AsyncLLM,
    params: SamplingParams = GREEDY,
    kv: dict[str, Any] | None = None,
    prompt: list[int] = PROMPT,
) -> tuple[list[int], dict[str, Any] | None]:
    tokens: list[int] = []
    answered = None
    async for out in engine.stream(prompt, params, kv_transfer_params=kv):
        for sample in out.outputs:
            tokens += sample.token_ids
        answered = out.kv_transfer_params or answered
    return tokens, answered


async def prefilled(pair: Pair) -> dict[str, Any]:
    tokens, params = await complete(pair.prefill, kv={"do_remote_decode": True})
    assert len(tokens) == 1  # a prefill instance computes the prompt and one token
    assert params is not None
    return params


def decode_figures(pair: Pair) -> tuple[int, int]:
    (row,) = pair.decode.stats().replicas
    return row.kv_pulls, row.kv_fallbacks


async def settled(pair: Pair, pulls: int, fallbacks: int) -> None:
    """Wait (bounded) for the decode engine's figures to reach these counts: its report reaches
    the root a moment after the output it counts."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10.0
    while decode_figures(pair) != (pulls, fallbacks) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    assert decode_figures(pair) == (pulls, fallbacks)


async def test_the_decode_instance_pulls_the_prefill_instance_kv_and_matches_transformers(
    pair: Pair,
) -> None:
    params = await prefilled(pair)
    assert params["num_tokens"] == 48 and len(params["block_ids"]) == 3
    pulls, fallbacks = decode_figures(pair)
    tokens, _ = await complete(pair.decode, kv=params)
    assert_greedy_matches_hf(pair.path, PROMPT, tokens)
    await settled(pair, pulls + 1, fallbacks)
    (prefill_row,) = pair.prefill.stats().replicas
    assert prefill_row.kv_handoffs >= 1


NOBODY = {"host": "127.0.0.1", "port": 1, "host_id": "elsewhere"}
TAMPERED = {
    "unknown-transfer": lambda p: {**p, "transfer_id": "no-such-request@0"},
    "other-dtype": lambda p: {**p, "layout": {**p["layout"], "dtype": "bfloat16"}},
    "other-tp-size": lambda p: {**p, "layout": {**p["layout"], "tp_size": 2}},
    "nobody-listening": lambda p: {**p, "endpoints": [NOBODY]},
}


def signed(pair: Pair, params: dict[str, Any], expires_in: float = 60.0) -> dict[str, Any]:
    """`params` signed with the deployment's secret, as a prefill instance of it could."""
    source = msgspec.convert({**params, "signature": ""}, KvSource)
    secret = instance_secret(pair.decode.settings)
    return msgspec.to_builtins(sign(source, secret, time.time() + expires_in))  # type: ignore[no-any-return]


@pytest.mark.parametrize("tamper", list(TAMPERED))
async def test_a_transfer_that_cannot_be_pulled_falls_back_to_local_prefill(
    pair: Pair, tamper: str
) -> None:
    params = signed(pair, TAMPERED[tamper](await prefilled(pair)))
    pulls, fallbacks = decode_figures(pair)
    tokens, _ = await complete(pair.decode, kv=params)
    assert_greedy_matches_hf(pair.path, PROMPT, tokens)
    await settled(pair, pulls, fallbacks + 1)


async def test_an_expired_transfer_falls_back_to_local_prefill(pair: Pair) -> None:
    params = await prefilled(pair)
    await asyncio.sleep(HOLD_TIMEOUT_S + 1.5)  # the prefill instance let the blocks go
    pulls, fallbacks = decode_figures(pair)
    tokens, _ = await complete(pair.decode, kv=params)
    assert_greedy_matches_hf(pair.path, PROMPT, tokens)
    await settled(pair, pulls, fallbacks + 1)


@pytest.mark.parametrize(
    ("role", "kv", "says"),
    [
        ("decode", {"transfer_id": 5}, "not a KV source"),
        ("decode", {"do_remote_decode": True}, "asks for a prefill instance"),
        ("prefill", {"transfer_id": "x@0"}, "for a decode instance"),
    ],
)
async def test_malformed_kv_transfer_params_are_a_400_naming_them(
    pair: Pair, role: str, kv: dict[str, Any], says: str
) -> None:
    engine = pair.decode if role == "decode" else pair.prefill
    with pytest.raises(EngineError) as raised:
        await complete(engine, kv=kv)
    assert raised.value.status == 400 and raised.value.param == "kv_transfer_params"
    assert says in raised.value.message
    # ... and it serves on.
    tokens, _ = await complete(engine)
    assert len(tokens) == GREEDY.max_tokens


@contextlib.contextmanager
def fake_source() -> Iterator[socket.socket]:
    """A listener on loopback (a peer's address) that a decode instance must never reach."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    with listener:
        yield listener


def connections(listener: socket.socket) -> int:
    count = 0
    with contextlib.suppress(BlockingIOError):
        while True:
            listener.accept()[0].close()
            count += 1
    return count


UNTRUSTED: dict[str, Callable[[Pair, dict[str, Any]], dict[str, Any]]] = {
    "forged": lambda pair, p: {**p, "signature": ""},
    "altered": lambda pair, p: p,  # the genuine signature over other endpoints
    "expired": lambda pair, p: signed(pair, p, expires_in=-1.0),
    "another-secret": lambda pair, p: msgspec.to_builtins(
        sign(msgspec.convert(p, KvSource), secrets.token_bytes(32), time.time() + 60)
    ),
}


@pytest.mark.parametrize("kind", list(UNTRUSTED))
async def test_untrusted_kv_transfer_params_are_a_400_before_any_connection(
    pair: Pair, kind: str
) -> None:
    genuine = await prefilled(pair)
    with fake_source() as listener:
        port = listener.getsockname()[1]
        redirected = {**genuine, "endpoints": [{**genuine["endpoints"][0], "port": port}]}
        with pytest.raises(EngineError) as refused:
            await complete(pair.decode, kv=UNTRUSTED[kind](pair, redirected))
        await asyncio.sleep(0.2)  # time enough for a connection, had one been started
        assert connections(listener) == 0
    assert refused.value.status == 400 and refused.value.param == "kv_transfer_params"
    assert "kv_transfer_params cannot be used" in refused.value.message


async def test_a_prompt_sent_with_another_prompts_kv_params_computes_its_own(pair: Pair) -> None:
    """Filed under this prompt's prefix, the other prompt's KV would serve every later request
    that shares it: the decode instance pulls nothing and prefills."""
    params = await prefilled(pair)
    other = [t + 1 for t in PROMPT]
    pulls, fallbacks = decode_figures(pair)
    tokens, _ = await complete(pair.decode, kv=params, prompt=other)
    assert_greedy_matches_hf(pair.path, other, tokens)
    await settled(pair, pulls, fallbacks + 1)
    tokens, _ = await complete(pair.decode, prompt=other)  # and no later request sees PROMPT's
    assert_greedy_matches_hf(pair.path, other, tokens)


async def test_a_peer_without_the_secret_is_refused_and_counted_and_the_pull_goes_on(
    pair: Pair,
) -> None:
    params = await prefilled(pair)
    endpoint = params["endpoints"][0]
    request = PullRequest(
        params["transfer_id"], params["block_ids"], params["layout"], host_id(), "tcp"
    )
    said = await asyncio.to_thread(attack, endpoint["port"], msgspec.msgpack.encode(request))
    assert len(said) == 2 and isinstance(said[0], Challenge) and said[1] == WireError("refused")

    pulls, fallbacks = decode_figures(pair)
    tokens, _ = await complete(pair.decode, kv=params)
    assert_greedy_matches_hf(pair.path, PROMPT, tokens)
    await settled(pair, pulls + 1, fallbacks)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10.0
    while pair.prefill.stats().replicas[0].kv_refused_connections < 1 and loop.time() < deadline:
        await asyncio.sleep(0.05)
    assert pair.prefill.stats().replicas[0].kv_refused_connections >= 1


def attack(port: int, payload: bytes) -> list[object]:
    """Send one frame to a kv_transfer port as a peer without the secret; all it answers."""
    return everything_said(port, struct.pack(">I", len(payload)) + payload)


async def test_a_thousand_unpulled_handoffs_leave_room_for_normal_requests(pair: Pair) -> None:
    """Any client of a prefill instance may ask for handoffs it never pulls. Held blocks stop at
    their share of the KV pool (engine/scheduler/kv_handoff.py), so normal requests sent among
    1,000 of them are admitted and answered as if alone."""
    rng = random.Random(0)
    (before,) = pair.prefill.stats().replicas
    # Prompts of three full blocks each, none sharing a block: unbounded, 1,000 holds would pin
    # far more blocks than the pool has.
    prompts = [[rng.randrange(3, 190) for _ in range(50)] for _ in range(1000)]
    handoffs = [complete(pair.prefill, kv={"do_remote_decode": True}, prompt=p) for p in prompts]
    normal = [complete(pair.prefill) for _ in range(8)]
    results = await asyncio.wait_for(asyncio.gather(*handoffs, *normal), WAIT_S)
    expected, _ = await complete(pair.decode)  # the same prompt on the other instance, alone
    assert all(tokens == expected for tokens, _ in results[len(prompts) :])
    assert all(len(tokens) == 1 for tokens, _ in results[: len(prompts)])
    (after,) = pair.prefill.stats().replicas
    assert after.kv_holds_refused > before.kv_holds_refused  # the cap was reached, and held
