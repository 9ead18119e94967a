"""`python -m engine tenants key`: a new API key and the line the tenants file holds for it.

The key is printed once, for its tenant; the file keeps only its SHA-256 (engine/tenants/).
With `--stdin`, the digest of a key read from standard input (one line) instead: a key given
out before, now moved into the tenants file.
"""

from __future__ import annotations

import secrets
import sys

from engine.tenants.table import key_digest

USAGE = "usage: python -m engine tenants key [--stdin]"


def run_tenants(argv: list[str]) -> int:
    if argv not in (["key"], ["key", "--stdin"]):
        print(USAGE, file=sys.stderr)
        return 2
    if "--stdin" in argv:
        key = sys.stdin.readline().strip()
        if not key:
            print("engine: no key on standard input", file=sys.stderr)
            return 2
    else:
        key = "sk-" + secrets.token_urlsafe(32)
        print(f"key: {key}")
    print(f'key_sha256 = "{key_digest(key)}"')
    return 0
