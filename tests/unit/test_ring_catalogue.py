"""The ring catalogue is consistent: its parties exist, its names are unique, and every actor
counts the malformed frames of exactly the channels of the rings its role reads."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import engine.actors
from engine.messages.ring_catalogue import CATALOGUE, read_by, ring_of
from engine.messages.roles import ROOT, Role
from engine.runtime.actor import Actor


def actor_classes() -> list[type[Actor]]:
    """Every actor of engine/actors (its runtime's base class aside), found by importing them."""
    for module in pkgutil.iter_modules(engine.actors.__path__, "engine.actors."):
        importlib.import_module(module.name)
    found, todo = [], list(Actor.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__module__.startswith("engine.actors."):
            found.append(cls)
    return found


def test_every_ring_is_between_parties_that_exist_under_a_name_of_its_own() -> None:
    parties = {ROOT, *Role}
    for ring in CATALOGUE:
        assert ring.writer in parties and set(ring.readers) <= parties, ring
        assert ring.readers, ring
    names = [ring.name for ring in CATALOGUE]
    assert len(set(names)) == len(names)
    for ring in CATALOGUE:  # no name, nor a per-rank ring's rank, is taken for another's
        assert ring_of(ring.at(3).name if ring.per_rank else ring.name) is ring


def test_every_actor_decodes_the_channels_of_the_rings_its_role_reads() -> None:
    classes = actor_classes()
    assert {cls.role for cls in classes} == set(Role)  # every role has its actor
    for cls in classes:
        read = {id(ring.channel) for ring in read_by(cls.role)}
        assert {id(channel) for channel in cls.channels} == read, cls
    assert read_by(ROOT)  # the root reads rings too (AsyncLLM: not an Actor)


def test_a_ring_name_outside_the_catalogue_is_a_clear_error() -> None:
    with pytest.raises(KeyError, match="no ring 'kv-event0'"):
        ring_of("kv-event0")
    with pytest.raises(KeyError):
        ring_of("kv-events")  # the family needs a rank
