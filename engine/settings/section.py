"""What every settings section shares (engine/settings/schema.py declares the sections)."""

from __future__ import annotations

import msgspec

# A byte count; in TOML, env and flags it may also be written "512MiB", "4GB", "1.5GiB".
BYTES_UNIT = {"unit": "bytes"}


class Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass
