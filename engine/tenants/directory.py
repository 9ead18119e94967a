"""The server's tenants, live: who an API key belongs to, the quotas' book, and reloads.

Three ways to run, as the settings say:
- `--api-keys-file FILE`: the tenants in the file (engine/tenants/tenants_file.py); a request
  must carry one of their keys. `reload()` (SIGHUP, the admin socket's `reload-tenants`) reads
  the file again without a restart: the new table applies from the next request, requests in
  flight finish under the old one; a file that cannot be used leaves the old table in place.
- `--api-key KEY`: one key, one tenant, as before tenants existed.
- neither: no key is asked for, and everyone is that one tenant.
"""

from __future__ import annotations

import logging
import threading

from engine.tenants.quotas import QuotaBook
from engine.tenants.table import EVERYONE, Tenant, TenantTable
from engine.tenants.tenants_file import read_tenants_file

log = logging.getLogger("engine.tenants")


class Tenants:
    def __init__(self, path: str | None = None) -> None:
        """`path`: the tenants file (None: one tenant for everyone). TenantsFileError if it
        cannot be used."""
        self.path = path
        self.table: TenantTable | None = read_tenants_file(path) if path else None
        self.quotas = QuotaBook(self.named)
        self.reloads = 0
        self._lock = threading.Lock()  # SIGHUP's handler and the admin socket may overlap

    @property
    def enabled(self) -> bool:
        """Whether requests run as the tenants of a file (else as the one tenant)."""
        return self.table is not None

    def find(self, key: str) -> Tenant | None:
        """The tenant of an API key; None when the file knows no such key."""
        return self.table.find(key) if self.table is not None else EVERYONE

    def named(self, name: str) -> Tenant | None:
        if self.table is None:
            return EVERYONE if name == EVERYONE.name else None
        return self.table.by_name.get(name)

    def all(self) -> list[Tenant]:
        return [EVERYONE] if self.table is None else list(self.table.by_name.values())

    def reload_on_signal(self) -> None:
        """SIGHUP's handler: reload, and say in the log why not when the file cannot be used."""
        try:
            self.reload()
        except ValueError as e:
            log.error("tenants not reloaded, the old ones stay: %s", e)

    def reload(self) -> str:
        """Read the tenants file again; a line saying what changed. TenantsFileError (the old
        table stays) when the file cannot be used; ValueError without a file."""
        if self.path is None:
            raise ValueError("the server has no tenants file (--api-keys-file) to reload")
        with self._lock:
            table = read_tenants_file(self.path)
            before = set(self.table.by_name) if self.table is not None else set()
            self.table = table
            self.reloads += 1
        after = set(table.by_name)
        added, removed = sorted(after - before), sorted(before - after)
        summary = f"{len(after)} tenants from {self.path}"
        if added:
            summary += f"; added {', '.join(added)}"
        if removed:
            summary += f"; removed {', '.join(removed)}"
        log.info("tenants reloaded: %s", summary)
        return summary


def tenant_rows(tenants: Tenants) -> list[dict[str, object]]:
    """Each tenant as the admin socket's `tenants` lists it: its settings and its minute's use
    (never a key or a key's digest)."""
    rows: list[dict[str, object]] = []
    for tenant in tenants.all():
        charged, reserved, in_flight = tenants.quotas.usage(tenant.name)
        rows.append(
            {
                "name": tenant.name,
                "weight": tenant.weight,
                "priority_ceiling": tenant.priority_ceiling,
                "tokens_per_minute": tenant.tokens_per_minute,
                "max_concurrent_requests": tenant.max_concurrent_requests,
                "models": None if tenant.models is None else list(tenant.models),
                "tokens_last_minute": charged,
                "tokens_reserved": reserved,
                "requests_in_flight": in_flight,
                "throttled": sum(
                    n for (name, _), n in tenants.quotas.throttled.items() if name == tenant.name
                ),
            }
        )
    return rows
