"""The run's rings: declarations by logical name, and the segment each one currently lives in.

A ring's segment is named `<run prefix>r.<ring>.<generation>`. Whenever a child that writes or
reads a ring restarts, the ring gets a fresh segment (the next generation): the dead child may
have left it half-read or full, and peers must not wait on it. The old segment is unlinked once
every live party has been handed the new one (their mappings stay valid until they close).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from engine.messages.control import InboundRing
from engine.runtime.child_spec import RingDecl
from engine.runtime.ring import RingSpec, create_ring, destroy_ring

Ends = tuple[dict[str, InboundRing], dict[str, RingSpec]]


class RingTable:
    def __init__(self, decls: Sequence[RingDecl], prefix: str, doorbell_dir: str = "") -> None:
        self._decls = {decl.name: decl for decl in decls}
        self._prefix = prefix
        self._doorbell_dir = doorbell_dir
        self._generation = dict.fromkeys(self._decls, 0)
        self._current: dict[str, RingSpec] = {}
        self._retired: list[RingSpec] = []

    def create_all(self) -> None:
        for name in self._decls:
            self._current[name] = self._create(name)

    def renew_touching(self, parties: Collection[str]) -> list[str]:
        """Give every ring that one of `parties` writes or reads a fresh segment; their names."""
        renewed = [name for name, decl in self._decls.items() if decl.parties & set(parties)]
        for name in renewed:
            self._generation[name] += 1
            self._retired.append(self._current[name])
            self._current[name] = self._create(name)
        return renewed

    def parties(self, rings: Collection[str]) -> set[str]:
        """Every party (child name or ROOT) with an end on one of `rings`."""
        return {party for name in rings for party in self._decls[name].parties}

    def ends_of(self, party: str, rings: Collection[str] | None = None) -> Ends:
        """`party`'s inbound and outbound rings (only those among `rings`, if given)."""
        inbound: dict[str, InboundRing] = {}
        outbound: dict[str, RingSpec] = {}
        for name, decl in self._decls.items():
            if rings is not None and name not in rings:
                continue
            if decl.writer == party:
                outbound[name] = self._current[name]
            if party in decl.readers:
                inbound[name] = InboundRing(self._current[name], decl.readers.index(party))
        return inbound, outbound

    def destroy_retired(self) -> None:
        for spec in self._retired:
            destroy_ring(spec)
        self._retired.clear()

    def destroy_all(self) -> None:
        self.destroy_retired()
        for spec in self._current.values():
            destroy_ring(spec)
        self._current.clear()

    def _create(self, name: str) -> RingSpec:
        decl = self._decls[name]
        spec = RingSpec(
            name=f"{self._prefix}r.{name}.{self._generation[name]}",
            capacity=decl.capacity,
            readers=len(decl.readers),
            doorbell_dir=self._doorbell_dir,
        )
        create_ring(spec)
        return spec
