"""Tenants as the server knows them (engine/tenants/): the tenants file, who a key belongs to,
what a tenant may ask for, and its quotas, counted on a clock the test moves."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.messages.params import SamplingParams
from engine.messages.requests import EngineRequest
from engine.request.outputs import EngineError
from engine.tenants.access import run_as, scoped_id
from engine.tenants.directory import Tenants
from engine.tenants.quotas import WINDOW_S, QuotaBook
from engine.tenants.table import EVERYONE, Tenant, key_digest
from engine.tenants.tenants_file import TenantsFileError

ALICE_KEY, BOB_KEY = "sk-alice-0123456789", "sk-bob-0123456789"


def tenants_file(tmp_path: Path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


GOOD = f"""
[tenants.alice]
key_sha256 = "{key_digest(ALICE_KEY)}"
weight = 3
tokens_per_minute = 1000
models = ["default", "qwen*"]

[tenants.bob]
key_sha256 = ["{key_digest(BOB_KEY)}", "{"0" * 64}"]
priority_ceiling = 5
cache_scope = "shared"
"""


def test_a_key_names_its_tenant_and_only_its_digest_is_kept(tmp_path: Path) -> None:
    tenants = Tenants(tenants_file(tmp_path, GOOD))
    alice, bob = tenants.find(ALICE_KEY), tenants.find(BOB_KEY)
    assert alice is not None and bob is not None
    assert (alice.name, alice.weight, alice.tokens_per_minute) == ("alice", 3.0, 1000)
    assert alice.may_use("qwen2-0.5b") and not alice.may_use("llama")
    assert bob.may_use("llama") and bob.default_priority == 5
    assert alice.tag is not None and bob.tag is not None
    assert alice.tag.cache_scope != bob.tag.cache_scope  # each its own unless it names one
    assert tenants.find("sk-unknown") is None and tenants.find("") is None
    assert tenants.table is not None
    assert ALICE_KEY not in repr(tenants.table)  # digests only


@pytest.mark.parametrize(
    ("text", "mode", "named"),
    [
        ('[tenants.a]\nkey_sha256 = "sk-plain-key"\n', 0o600, "tenants.a.key_sha256"),
        (f'[tenants.a]\nkey_sha256 = "{"a" * 64}"\nweight = 0\n', 0o600, "tenants.a.weight"),
        (f'[tenants.a]\nkey_sha256 = "{"a" * 64}"\nsurprise = 1\n', 0o600, "surprise"),
        (
            f'[tenants.a]\nkey_sha256 = "{"a" * 64}"\n[tenants.b]\nkey_sha256 = "{"a" * 64}"\n',
            0o600,
            "also tenant 'a'",
        ),
        (f'[tenants."a b"]\nkey_sha256 = "{"a" * 64}"\n', 0o600, "'a b'"),
        (f'[tenants.a]\nkey_sha256 = "{"a" * 64}"\n', 0o666, "writable by other users"),
        ("[tenants\n", 0o600, "not valid TOML"),
    ],
)
def test_a_tenants_file_that_cannot_be_used_is_refused_naming_what_is_wrong(
    tmp_path: Path, text: str, mode: int, named: str
) -> None:
    with pytest.raises(TenantsFileError, match="tenants file") as refused:
        Tenants(tenants_file(tmp_path, text, mode))
    assert named in str(refused.value)


def test_a_reload_applies_the_new_file_and_a_bad_one_keeps_the_old(tmp_path: Path) -> None:
    path = tenants_file(tmp_path, GOOD)
    tenants = Tenants(path)
    Path(path).write_text(f'[tenants.carol]\nkey_sha256 = "{key_digest("sk-carol")}"\n')
    assert tenants.reload() == f"1 tenants from {path}; added carol; removed alice, bob"
    assert tenants.find("sk-carol") is not None and tenants.find(ALICE_KEY) is None
    Path(path).write_text("[tenants\n")
    with pytest.raises(TenantsFileError):
        tenants.reload()
    assert tenants.find("sk-carol") is not None


def engine_request() -> EngineRequest:
    return EngineRequest(params=SamplingParams(max_tokens=4), prompt="hi")


def test_a_tenant_runs_its_requests_within_its_models_and_priority_ceiling() -> None:
    tenant = Tenant("bob", weight=2.0, priority_ceiling=5, models=("small*",), cache_scope="s")
    request = engine_request()
    run_as(tenant, [request], "small-1", None, "salt")
    assert request.tenant == tenant.tag and request.priority == 5
    assert request.cache_salt == "salt"
    with pytest.raises(EngineError) as refused:
        run_as(tenant, [request], "small-1", 4, None)  # more urgent than its ceiling
    assert (refused.value.status, refused.value.param) == (403, "priority")
    with pytest.raises(EngineError) as refused:
        run_as(tenant, [request], "big", None, None)
    assert (refused.value.status, refused.value.param) == (404, "model")
    run_as(EVERYONE, [request], "anything", -3, None)  # no tenants file: no tag, no ceiling
    assert request.tenant is None and request.priority == -3
    assert scoped_id(tenant, "x") == "bob/x" and scoped_id(EVERYONE, "x") == "x"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_concurrent_requests_past_the_limit_get_429_until_one_ends() -> None:
    book = QuotaBook(lambda name: Tenant(name, max_concurrent_requests=2), Clock())
    leases = [book.admit("a", 10), book.admit("a", 10)]
    with pytest.raises(EngineError) as refused:
        book.admit("a", 10)
    assert (refused.value.status, refused.value.retry_after) == (429, 1)
    assert "max_concurrent_requests 2" in refused.value.message
    book.admit("b", 10)  # another tenant is not held back
    leases[0].settle(5)
    book.admit("a", 10)
    assert book.throttled["a", "concurrent_requests"] == 1


def test_tokens_per_minute_refuse_at_the_limit_and_recover_after_the_window() -> None:
    clock = Clock()
    book = QuotaBook(lambda name: Tenant(name, tokens_per_minute=100), clock)
    first = book.admit("a", 60)  # reserves its most: 60
    second = book.admit("a", 60)  # fits (60 < 100), admitted whole
    with pytest.raises(EngineError) as refused:
        book.admit("a", 1)
    assert refused.value.retry_after == 1  # only requests in flight hold it: soon
    # An aborted request is charged only what it used; a finished one what it cost.
    first.settle(10)
    second.settle(60)
    assert book.usage("a") == (70, 0, 0)
    clock.now += 30
    third = book.admit("a", 40)  # 70 charged + 40 reserved: past the limit for the next one
    with pytest.raises(EngineError) as refused:
        book.admit("a", 1)
    third.settle(40)
    # The oldest charge (10, then 60) leaves the window 30 s from now.
    assert refused.value.retry_after == WINDOW_S - 30
    clock.now += WINDOW_S - 30
    book.admit("a", 1)
