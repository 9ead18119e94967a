"""The ring catalogue is consistent: its parties exist, its names are unique, every actor
counts the malformed frames of exactly the channels of the rings its role reads, every replica's
plan declares its rings between the roles the catalogue names, and the root takes in every ring
it reads."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import engine.actors
from engine.inflight.inbound import take_in
from engine.inflight.registry import Gateway
from engine.launch.plan import plan_engine
from engine.library.llm import build_settings
from engine.messages.outputs import OutputBatch, SampleDeltaText, TextStarted
from engine.messages.params import SamplingParams
from engine.messages.reports import SchedulerReport
from engine.messages.requests import EngineRequest, PromptTokens
from engine.messages.ring_catalogue import (
    CATALOGUE,
    OUTPUTS_RING,
    PLAN_RING,
    PROMPTS_RING,
    REPORTS_RING,
    REQUESTS_RING,
    RESULTS_RING,
    STOPS_RING,
    SUBMIT_RING,
    TOKENS_RING,
    read_by,
    ring_of,
)
from engine.messages.roles import ROOT, Role
from engine.messages.scheduling import SchedulerStats
from engine.request.outputs import RequestOutput
from engine.runtime.actor import Actor
from tests.checkpoints import tiny_checkpoint


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


@pytest.mark.parametrize(
    "flags",
    [
        {"parallel.data_parallel_size": 2},
        {
            "kv_transfer.prefill_replicas": 1,
            "kv_transfer.decode_replicas": 1,
            "kv_transfer.port": 7100,
        },
    ],
    ids=["dp", "pd"],
)
def test_every_replica_declares_the_request_path_between_the_roles_the_catalogue_names(
    flags: dict[str, int],
) -> None:
    path = tiny_checkpoint(arch="llama")
    settings = build_settings(
        **{"model.path": str(path), "model.max_model_len": 256, "cache.kv_cache_memory": 2**20},
        **flags,
    )
    plan = plan_engine(settings, str(path))
    request_path = {REQUESTS_RING, SUBMIT_RING, PROMPTS_RING, PLAN_RING, RESULTS_RING}
    request_path |= {TOKENS_RING, STOPS_RING, OUTPUTS_RING, REPORTS_RING}
    assert len(plan.replica_specs) == 2
    for spec in plan.replica_specs:
        role_of = {child.name: child.role for child in spec.children} | {ROOT: ROOT}
        declared = {ring_of(decl.name) for decl in spec.rings}
        assert request_path <= {ring.entry if ring.per_rank else ring for ring in declared}
        for decl in spec.rings:
            entry = ring_of(decl.name)
            assert role_of[decl.writer] == entry.writer, decl
            assert {role_of[reader] for reader in decl.readers} == set(entry.readers), decl


def test_the_root_takes_in_every_ring_it_reads() -> None:
    """One message of each ring the root reads, outputs ahead of the prompt ids they need."""
    gateway = Gateway()
    record, _ = gateway.register(
        EngineRequest(params=SamplingParams(max_tokens=1), prompt="hi", request_id="r")
    )
    delta = SampleDeltaText("r", 0, 0, [7], "x", None, "length")
    report = SchedulerReport(SchedulerStats(num_steps=3), [])
    frames = {
        OUTPUTS_RING: OUTPUTS_RING.encode(OutputBatch([TextStarted("r", 0)], [delta], [])),
        PROMPTS_RING: PROMPTS_RING.encode(PromptTokens("r", 0, [4, 5])),
        REPORTS_RING: REPORTS_RING.encode(report),
    }
    assert set(frames) == set(read_by(ROOT))
    assert take_in(gateway, [(ring.name, [frame]) for ring, frame in frames.items()]) == report
    output = record.stream.get_nowait()
    assert isinstance(output, RequestOutput) and output.finished
    assert output.prompt_token_ids == [4, 5] and output.outputs[0].token_ids == [7]
