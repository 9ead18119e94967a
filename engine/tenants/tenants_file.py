"""The tenants file (`--api-keys-file`): TOML, a table per tenant, keys stored as digests.

    # share_prefix_cache = true    # every tenant's requests share cached prefixes
    [tenants.alice]
    key_sha256 = "<hex>"           # or a list, to rotate keys: `engine tenants key` makes one
    weight = 3                     # its share of each step's tokens while others wait
    priority_ceiling = 0           # the most urgent priority it may ask for (lower runs first)
    tokens_per_minute = 200000     # prompt + generated tokens a minute; 0 or absent: no limit
    max_concurrent_requests = 16   # requests in flight at once; 0 or absent: no limit
    models = ["default", "qwen*"]  # models it may use (shell patterns); absent: every one
    cache_scope = "team-a"         # tenants naming one scope share cached prefixes

The file is read as the API key file is: a regular file, not writable by other users. Every
problem is one line naming the file and the field (a tenant's name, a field's path).
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
from typing import Annotated

import msgspec
from msgspec import Meta

from engine.tenants.table import Tenant, TenantTable

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
MAX_FILE_BYTES = 4 * 1024 * 1024


class TenantsFileError(ValueError):
    """The tenants file cannot be used; the message names the file and the problem."""


class TenantEntry(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    key_sha256: str | list[str]
    weight: Annotated[float, Meta(gt=0.0, le=1e6)] = 1.0
    priority_ceiling: int = 0
    tokens_per_minute: Annotated[int, Meta(ge=0)] = 0
    max_concurrent_requests: Annotated[int, Meta(ge=0)] = 0
    models: list[str] | None = None
    cache_scope: Annotated[str, Meta(min_length=1, max_length=256)] | None = None


class TenantsFile(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    tenants: dict[str, TenantEntry]
    share_prefix_cache: bool = False


def read_tenants_file(path: str) -> TenantTable:
    """The tenants `path` names; TenantsFileError naming what is wrong."""
    try:
        data = tomllib.loads(_read_private(path))
    except tomllib.TOMLDecodeError as exc:
        raise TenantsFileError(f"the tenants file {path} is not valid TOML: {exc}") from None
    tenants = data.get("tenants")
    try:
        if isinstance(tenants, dict):  # each tenant alone, for its name in the message
            for name, entry in tenants.items():
                where = f"tenants.{name}"
                msgspec.convert(entry, TenantEntry)
        where = ""
        parsed = msgspec.convert(data, TenantsFile)
    except msgspec.ValidationError as exc:
        raise TenantsFileError(f"the tenants file {path}: {_named(exc, where)}") from None
    return _table(path, parsed)


def _read_private(path: str) -> str:
    """The file's text, refused when it is not a regular file or other users may write it."""
    try:
        fd = os.open(os.path.expanduser(path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise TenantsFileError(f"cannot read the tenants file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TenantsFileError(f"the tenants file {path} is not a regular file")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise TenantsFileError(f"the tenants file {path} is writable by other users")
        raw = file.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise TenantsFileError(f"the tenants file {path} is over {MAX_FILE_BYTES} bytes")
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise TenantsFileError(f"the tenants file {path} is not UTF-8 text") from None


def _named(exc: msgspec.ValidationError, prefix: str) -> str:
    """msgspec's message with its path in TOML's words (`$.weight` within `tenants.a`:
    tenants.a.weight)."""
    message, _, where = str(exc).partition(" - at `$")
    where = (prefix + where.rstrip("`")).lstrip(".")
    return f"{where}: {message}" if where else message


def _table(path: str, parsed: TenantsFile) -> TenantTable:
    if not parsed.tenants:
        raise TenantsFileError(f"the tenants file {path} names no tenant ([tenants.NAME])")
    by_name: dict[str, Tenant] = {}
    by_digest: dict[str, Tenant] = {}
    for name, entry in parsed.tenants.items():
        if not _NAME.fullmatch(name):
            raise TenantsFileError(
                f"the tenants file {path}: tenant name {name!r} must be 1 to 64 letters, "
                "digits, '_', '.' or '-', starting with a letter or digit"
            )
        tenant = Tenant(
            name=name,
            weight=entry.weight,
            priority_ceiling=entry.priority_ceiling,
            tokens_per_minute=entry.tokens_per_minute,
            max_concurrent_requests=entry.max_concurrent_requests,
            models=None if entry.models is None else tuple(entry.models),
            cache_scope=_cache_scope(name, entry.cache_scope, parsed.share_prefix_cache),
        )
        by_name[name] = tenant
        digests = [entry.key_sha256] if isinstance(entry.key_sha256, str) else entry.key_sha256
        for digest in digests:
            _add_digest(path, by_digest, digest.lower(), tenant)
    return TenantTable(by_name, by_digest)


def _cache_scope(name: str, scope: str | None, everyone_shares: bool) -> str:
    """Where a tenant's cached prefixes live: its own scope unless it names one shared with
    others, or the file shares one among all ("")."""
    if everyone_shares:
        return ""
    return f"scope:{scope}" if scope is not None else f"tenant:{name}"


def _add_digest(path: str, by_digest: dict[str, Tenant], digest: str, tenant: Tenant) -> None:
    field = f"tenants.{tenant.name}.key_sha256"
    if not _DIGEST.fullmatch(digest):
        raise TenantsFileError(
            f"the tenants file {path}: {field}: expected the 64 hex digits of a key's SHA-256 "
            "(`engine tenants key` prints one), never the key itself"
        )
    other = by_digest.get(digest)
    if other is not None:
        raise TenantsFileError(
            f"the tenants file {path}: {field}: the same key is also tenant {other.name!r}'s"
        )
    by_digest[digest] = tenant
