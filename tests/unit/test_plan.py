"""Parallel topologies, without processes: which sizes split a model, where ranks live across
hosts, and that every invalid topology fails at planning time with a message naming the setting
and the numbers at fault (the CLI prints it as one line: tests/e2e/test_multi_host.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest

from engine.actors.configs import KvTransferConfig, WorkerConfig
from engine.launch import kv_disk_plan
from engine.launch.lasting_kv import kv_outlives_workers
from engine.launch.plan import plan_engine
from engine.launch.ranks import plan_worker_node
from engine.launch.sizing import check_parallel
from engine.library.llm import build_settings
from engine.messages.ring_catalogue import KV_EVENTS_RING, KV_ORDERS_RING
from engine.model.config import ModelConfig, load_model_config
from engine.model.parallel.config import Placement
from engine.model.parallel.layout import check_tensor_parallel, rank_shape
from engine.scheduler.config import SchedulerConfig
from engine.settings import Settings
from tests.checkpoints import tiny_checkpoint


@pytest.fixture(scope="module")
def path() -> Path:
    return tiny_checkpoint(arch="llama")  # 4 heads, 2 KV heads, 128 MLP columns, 512 ids


@pytest.fixture(scope="module")
def config(path: Path) -> ModelConfig:
    return load_model_config(path)


def with_sizes(config: ModelConfig, **sizes: int) -> ModelConfig:
    return dataclasses.replace(config, **sizes)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_sizes_that_divide_heads_and_columns_are_accepted(config: ModelConfig, size: int) -> None:
    check_tensor_parallel(config, size)
    shapes = [rank_shape(config, rank, size) for rank in range(size)]
    assert sum(shape.num_heads for shape in shapes) == config.num_heads
    assert sum(shape.intermediate_size for shape in shapes) == config.intermediate_size


def test_a_size_that_does_not_divide_the_heads_names_both_numbers(config: ModelConfig) -> None:
    with pytest.raises(ValueError) as error:
        check_tensor_parallel(config, 3)
    message = str(error.value)
    assert message.startswith("tensor_parallel_size 3 does not divide the model")
    assert "num_attention_heads 4 is not divisible by 3" in message
    assert "intermediate_size 128 is not divisible by 3" in message


def test_more_ranks_than_kv_heads_must_be_a_multiple_of_them(config: ModelConfig) -> None:
    three_kv = with_sizes(config, num_heads=12, num_kv_heads=3, intermediate_size=96)
    check_tensor_parallel(three_kv, 3)
    check_tensor_parallel(three_kv, 6)  # each KV head replicated on two ranks
    with pytest.raises(ValueError, match=r"num_key_value_heads 3 .* not divisible by 4"):
        check_tensor_parallel(three_kv, 4)


def test_mlp_columns_that_do_not_split_are_named(config: ModelConfig) -> None:
    with pytest.raises(ValueError, match=r"intermediate_size 130 is not divisible by 4$"):
        check_tensor_parallel(with_sizes(config, intermediate_size=130), 4)


def test_each_host_runs_an_equal_share_of_every_replicas_ranks() -> None:
    head = Placement(tensor_parallel_size=4, data_parallel_size=3, nnodes=2, node_rank=0)
    head.validate()
    assert (list(head.ranks_on(0)), list(head.ranks_on(1))) == ([0, 1], [2, 3])
    assert head.local_ranks == 6  # 2 ranks x 3 replicas share a host's cores


@pytest.mark.parametrize(
    ("placement", "message"),
    [
        (Placement(2, 1, nnodes=2, node_rank=2), "node_rank 2 is out of range for nnodes 2"),
        (Placement(2, 1, nnodes=1, node_rank=1), "node_rank 1 is out of range for nnodes 1"),
        (Placement(3, 1, nnodes=2), "tensor_parallel_size 3 is not divisible by parallel.nnodes 2"),
        (Placement(1, 2, nnodes=2), "tensor_parallel_size 1 is not divisible by parallel.nnodes 2"),
    ],
)
def test_placements_that_cannot_be_laid_out_fail(placement: Placement, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        placement.validate()


def settings_of(**parallel: object) -> Settings:
    return build_settings(**{f"parallel.{name}": value for name, value in parallel.items()})


def test_across_hosts_a_master_port_is_required_and_must_leave_room_for_replicas(
    config: ModelConfig,
) -> None:
    with pytest.raises(ValueError, match=r"master_port must be set .*nnodes is 2"):
        check_parallel(settings_of(tensor_parallel_size=2, nnodes=2), config)
    crowded = settings_of(tensor_parallel_size=2, data_parallel_size=3, nnodes=2, master_port=65534)
    with pytest.raises(ValueError, match="master_port 65534 leaves no port for replica 2"):
        check_parallel(crowded, config)
    roomy = settings_of(tensor_parallel_size=2, data_parallel_size=2, nnodes=2, master_port=65534)
    assert check_parallel(roomy, config).ranks_per_node == 1


def test_planning_an_engine_that_does_not_fit_the_checkpoint_fails_naming_both(
    path: Path,
) -> None:
    settings = build_settings(
        **{"parallel.tensor_parallel_size": 8, "cache.kv_cache_memory": 2**20}
    )
    with pytest.raises(ValueError, match=r"tensor_parallel_size 8 .*num_attention_heads 4"):
        plan_engine(settings, str(path))


def test_a_dp_by_tp_plan_has_one_supervised_pipeline_per_replica(path: Path) -> None:
    settings = build_settings(
        **{
            "parallel.tensor_parallel_size": 2,
            "parallel.data_parallel_size": 2,
            "cache.kv_cache_memory": 2**20,
            "model.max_model_len": 256,
        }
    )
    plan = plan_engine(settings, str(path))
    names = [[child.name for child in spec.children] for spec in plan.replica_specs]
    assert names == [
        ["worker0-r0", "worker1-r0", "scheduler-r0", "detokenizer-r0", "tokenizer-r0"],
        ["worker0-r1", "worker1-r1", "scheduler-r1", "detokenizer-r1", "tokenizer-r1"],
    ]
    groups = {child.group for spec in plan.replica_specs for child in spec.children[:2]}
    assert groups == {"workers-r0", "workers-r1"}  # each TP group restarts as one


def test_a_worker_node_plans_only_its_ranks_and_node_zero_is_not_one(path: Path) -> None:
    flags = {
        "parallel.tensor_parallel_size": 4,
        "parallel.nnodes": 2,
        "parallel.master_port": 29500,
    }
    node1 = build_settings(**flags, **{"parallel.node_rank": 1, "parallel.data_parallel_size": 2})
    specs = plan_worker_node(node1, str(path))
    assert [[child.name for child in spec.children] for spec in specs] == [
        ["worker2-r0", "worker3-r0"],
        ["worker2-r1", "worker3-r1"],
    ]
    with pytest.raises(ValueError, match="node_rank 0 serves the API"):
        plan_worker_node(build_settings(**flags), str(path))


def test_a_pd_plan_gives_each_replica_kv_transfer_actors_sharing_each_rank_cache(
    path: Path,
) -> None:
    settings = build_settings(
        **{
            "model.path": str(path),
            "cache.kv_cache_memory": 2**20,
            "parallel.tensor_parallel_size": 2,
            "kv_transfer.prefill_replicas": 1,
            "kv_transfer.decode_replicas": 2,
            "kv_transfer.port": 7100,
        }
    )
    plan = plan_engine(settings, str(path))
    assert plan.replica_roles == ("prefill", "decode", "decode")
    ports = []
    for replica, spec in enumerate(plan.replica_specs):
        names = {child.name for child in spec.children}
        transfers = [f"kv_transfer{rank}-r{replica}" for rank in range(2)]
        assert set(transfers) <= names
        for rank, name in enumerate(transfers):
            (segment,) = [s for s in spec.segments if name in s.parties]
            # ... and its scheduler, whose disk tier reads and writes it
            scheduler = f"scheduler-r{replica}"
            assert segment.parties == (f"worker{rank}-r{replica}", name, scheduler)
            (child,) = [c for c in spec.children if c.name == name]
            config = msgspec.msgpack.decode(child.config, type=KvTransferConfig)
            assert config.layout.segment_bytes == segment.size
            assert config.layout.num_blocks == plan.num_blocks and config.layout.tp_rank == rank
            ports.append(config.port)
        rings = {ring.name: ring for ring in spec.rings}
        assert rings[KV_ORDERS_RING.name].readers == tuple(transfers)
        assert [rings[KV_EVENTS_RING.at(r).name].writer for r in range(2)] == transfers
    assert ports == list(range(7100, 7106))  # no two ranks of the launch share a port


def test_a_cpu_plan_keeps_each_rank_kv_cache_and_the_prefix_index_in_segments_of_the_run(
    path: Path, config: ModelConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kv_disk_plan, "TIER_DIRECTORY", "kv-disk")  # the suite's is elsewhere
    settings = build_settings(
        **{
            "model.path": str(path),
            "runtime.engine_home": str(tmp_path),
            "cache.kv_cache_memory": 2**20,
            "parallel.tensor_parallel_size": 2,
        }
    )
    plan = plan_engine(settings, str(path))
    assert plan.replica_roles == ("both",)
    assert not [c for c in plan.spec.children if c.role == "kv_transfer"]
    segments = {segment.name: segment for segment in plan.spec.segments}
    # K and V of every layer, this rank's KV heads, every block's slots and the padding slot.
    slots = plan.num_blocks * settings.cache.block_size + 1
    rank_bytes = 2 * config.num_layers * slots * (config.num_kv_heads // 2) * config.head_dim * 4
    for rank in range(2):
        worker = next(c for c in plan.spec.children if c.name == f"worker{rank}")
        worker_config = msgspec.msgpack.decode(worker.config, type=WorkerConfig)
        segment = segments[worker_config.kv_cache_segment]
        # The scheduler maps it too: its disk tier's thread copies blocks in and out.
        assert (segment.parties, segment.size) == ((f"worker{rank}", "scheduler"), rank_bytes)
    scheduler = next(c for c in plan.spec.children if c.name == "scheduler")
    scheduler_config = msgspec.msgpack.decode(scheduler.config, type=SchedulerConfig)
    assert scheduler_config.kv_outlives_workers
    index = segments[scheduler_config.prefix_index_segment]
    assert (index.parties, index.size) == (("scheduler",), 16 * plan.num_blocks)
    disk = scheduler_config.kv_disk
    assert disk is not None and disk.path == str(tmp_path / "kv-disk")
    assert disk.cache_segments == ["kv-cache0", "kv-cache1"]
    assert [layout.tp_rank for layout in disk.layouts] == [0, 1]
    assert f"kv_dtype={disk.layouts[0].dtype}" in disk.description


def test_only_the_cpu_of_one_host_keeps_the_kv_cache_in_the_run_segments() -> None:
    assert kv_outlives_workers("cpu", Placement(tensor_parallel_size=2, data_parallel_size=1))
    assert not kv_outlives_workers(
        "cuda:0", Placement(tensor_parallel_size=1, data_parallel_size=1)
    )
    assert not kv_outlives_workers("cpu", Placement(2, 1, nnodes=2))


def test_every_worker_rank_is_told_the_engine_home_its_cpu_kernel_is_built_in(
    path: Path, tmp_path: Path
) -> None:
    home = str(tmp_path / "home")
    settings = build_settings(
        **{
            "parallel.tensor_parallel_size": 2,
            "runtime.engine_home": home,
            "cache.kv_cache_memory": 2**20,
            "model.max_model_len": 256,
        }
    )
    workers = [
        msgspec.msgpack.decode(child.config, type=WorkerConfig)
        for spec in plan_engine(settings, str(path)).replica_specs
        for child in spec.children
        if child.name.startswith("worker")
    ]
    assert [worker.engine_home for worker in workers] == [home, home]


def test_deterministic_mode_plans_small_steps_on_one_thread(path: Path) -> None:
    settings = build_settings(**{"model.path": str(path), "model.deterministic": True})
    spec = plan_engine(settings, str(path)).spec
    child = next(c for c in spec.children if c.name.startswith("worker"))
    worker = msgspec.msgpack.decode(child.config, type=WorkerConfig)
    assert worker.num_threads == 1


def test_without_max_model_len_the_engine_takes_what_the_cache_holds(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The tiny model's context is 4,096 tokens; a 1 MiB cache holds 2,048 of them (512 bytes a
    token). Unset, max_model_len is what the cache holds, and the start log says so; set to what
    the cache cannot hold, the start is refused, naming both; a larger cache gives the model's
    whole context."""
    small = {"cache.kv_cache_memory": 2**20}
    with caplog.at_level("INFO", logger="engine.launch.plan"):
        plan = plan_engine(build_settings(**small), str(path))
    assert plan.max_model_len == plan.num_blocks * 16 == 2048
    assert plan.spec.children[0].name == "worker0"
    worker = msgspec.msgpack.decode(plan.spec.children[0].config, type=WorkerConfig)
    assert worker.max_model_len == 2048
    assert "max_model_len 2048: what the KV cache holds, less than the model's context of 4096" in (
        caplog.text
    )
    # the dtype served, and what vLLM-CPU's auto would serve instead (tests/unit/test_loader.py)
    assert "dtype: float32 (--dtype auto; the checkpoint's float32); vLLM-CPU's" in caplog.text
    with pytest.raises(ValueError, match=r"holds 2048 tokens .* fewer than max_model_len 4096"):
        plan_engine(build_settings(**small, **{"model.max_model_len": 4096}), str(path))
    roomy = plan_engine(build_settings(**{"cache.kv_cache_memory": 4 * 2**20}), str(path))
    assert roomy.max_model_len == 4096
