"""The catalogue (engine/catalogue/entries.py: --models-dir, models.toml) and the pool's rules
(engine/catalogue/pool.py: load on first request, LRU unload within the count and the memory
budget, never under requests in flight, keep_alive), driven without processes: the pool is the
unit here, and its engines are plain objects that record their starts and stops."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from engine.catalogue.entries import CatalogueEntry, build_catalogue
from engine.catalogue.pool import ModelPool, PoolLimits
from engine.http.ollama.options import sampling_of
from engine.http.openai.errors import ApiError
from engine.request.outputs import EngineError
from engine.settings import SettingsError, load_settings
from engine.settings.durations import parse_keep_alive


def test_keep_alive_reads_ollamas_durations() -> None:
    assert [parse_keep_alive(v) for v in ("5m", "1h30m", "90", 30, "0", "2.5s")] == [
        300.0,
        5400.0,
        90.0,
        30.0,
        0.0,
        2.5,
    ]
    assert parse_keep_alive("-1") == parse_keep_alive(-1) == parse_keep_alive("-5m") == math.inf
    for bad in ("5 minutes", "m", "", True, [1]):
        with pytest.raises(ValueError, match="keep_alive must be"):
            parse_keep_alive(bad)


def test_a_models_directory_names_each_model_and_models_toml_sets_aliases_and_settings(
    tmp_path: Path,
) -> None:
    (tmp_path / "small.gguf").write_bytes(b"")
    (tmp_path / "split-00002-of-00002.gguf").write_bytes(b"")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "notes").mkdir()
    (tmp_path / "models.toml").write_text(
        '[hf]\naliases = ["hf:1b"]\nmax_model_len = 512\nkeep_alive = "10m"\n'
        '"scheduler.max_num_seqs" = 4\n'
    )
    settings, _ = load_settings(["--models-dir", str(tmp_path)], {})
    entries = {entry.name: entry for entry in build_catalogue(settings)}
    assert sorted(entries) == ["hf", "small"]  # no --model: the default model is not served
    hf = entries["hf"]
    assert hf.names == ("hf", "hf:1b") and hf.keep_alive == 600.0
    assert hf.settings.model.max_model_len == 512 and hf.settings.scheduler.max_num_seqs == 4
    assert entries["small"].settings.model.max_model_len is None
    assert entries["small"].path == str(tmp_path / "small.gguf")


@pytest.mark.parametrize(
    ("toml", "complaint"),
    [
        ("[hf]\nport = 1\n", "'port' is not a per-model setting"),
        ("[hf]\nmax_model_len = -1\n", "invalid setting model.max_model_len"),
        ('[ghost]\naliases = ["g"]\n', "no model named 'ghost'"),
        ('[hf]\naliases = ["small"]\n', "model name 'small' is claimed twice"),
    ],
)
def test_a_wrong_models_toml_is_refused_naming_the_table_and_setting(
    tmp_path: Path, toml: str, complaint: str
) -> None:
    (tmp_path / "small.gguf").write_bytes(b"")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "models.toml").write_text(toml)
    settings, _ = load_settings(["--models-dir", str(tmp_path)], {})
    with pytest.raises(SettingsError, match=complaint):
        build_catalogue(settings)


def test_ollama_options_map_onto_ours_and_samplers_we_lack_are_refused() -> None:
    sampling = sampling_of(
        {"num_predict": 7, "repeat_penalty": 1.2, "stop": "x", "num_gpu": 99, "num_ctx": 256},
        max_model_len=512,
        fmt="json",
    )
    params = sampling.params
    assert (params.max_tokens, params.repetition_penalty, params.stop) == (7, 1.2, ["x"])
    assert params.structured_outputs is not None and params.structured_outputs.json_object
    assert "temperature" in sampling.defaulted and "max_tokens" not in sampling.defaulted
    assert sampling.field_names["repetition_penalty"] == "options.repeat_penalty"
    assert sampling_of({"num_predict": -1}, 512).params.max_tokens is None
    for options, field in (
        ({"mirostat": 2}, "options.mirostat"),
        ({"num_ctx": 4096}, "options.num_ctx"),
        ({"no_such": 1}, "options.no_such"),
        ({"top_k": "many"}, "options.top_k"),
    ):
        with pytest.raises(ApiError) as refused:
            sampling_of(options, 512)
        assert refused.value.param == field


class Engine:
    """A model's engine as the pool sees it: started, stopped, its memory."""

    def __init__(self, entry: CatalogueEntry, log: list[str], fail: bool = False) -> None:
        self.name, self.log, self.fail = entry.name, log, fail

    async def start(self) -> None:
        if self.fail:
            raise ValueError("no such architecture")
        self.log.append(f"start {self.name}")

    async def stop(self, reason: str) -> None:
        self.log.append(f"stop {self.name}")

    def failure(self) -> str | None:
        return None

    def memory_bytes(self) -> int:
        return 100


def pool(names: list[str], log: list[str], **limits: object) -> ModelPool[Engine]:
    settings, _ = load_settings(["--model", "demo"], {})
    entries = [CatalogueEntry((name,), settings, "test") for name in names]
    return ModelPool(
        entries,
        lambda entry, room: Engine(entry, log, fail=entry.name == "bad"),
        lambda entry: 100,
        PoolLimits(**limits),  # type: ignore[arg-type]
    )


async def test_the_least_recently_used_idle_model_makes_room_and_busy_ones_are_kept() -> None:
    log: list[str] = []
    models = pool(["a", "b", "c", "d"], log, max_loaded=2, memory_budget=1000)
    a = await models.acquire("a")
    b = await models.acquire("b")
    b.release()
    (await models.acquire("c")).release()  # a is busy: b, idle, goes
    assert log == ["start a", "start b", "stop b", "start c"]
    waiting = asyncio.ensure_future(models.acquire("d"))  # only c is idle
    await asyncio.sleep(0.05)
    assert log[-2:] == ["stop c", "start d"]
    (await waiting).release()
    a.release()
    assert models.slots["a"].state == "loaded"  # released: idle, kept by keep_alive


async def test_memory_budget_counts_each_models_bytes_and_a_model_too_big_fails_alone() -> None:
    log: list[str] = []
    models = pool(["a", "b"], log, max_loaded=5, memory_budget=150)
    (await models.acquire("a")).release()
    (await models.acquire("b")).release()  # 200 > 150: a goes first
    assert log == ["start a", "stop a", "start b"]
    models = pool(["b", "bad"], log, max_loaded=5, memory_budget=250)
    (await models.acquire("b")).release()
    with pytest.raises(EngineError, match="model 'bad' failed to load: no such architecture"):
        await models.acquire("bad")
    assert models.slots["bad"].state == "failed" and models.slots["b"].state == "loaded"
    with pytest.raises(EngineError, match="model 'nope' not found") as missing:
        await models.acquire("nope")
    assert missing.value.status == 404


async def test_keep_alive_0_unloads_after_the_last_request_and_never_under_one() -> None:
    log: list[str] = []
    models = pool(["a"], log, keep_alive=300.0)
    first = await models.acquire("a", keep_alive=0)
    second = await models.acquire("a")
    first.release()
    await asyncio.sleep(0.05)
    assert models.slots["a"].state == "loaded"  # the second request still runs
    second.release()  # the last one's keep_alive is the model's: 300 s, from now
    assert models.slots["a"].expires_at is not None
    (await models.acquire("a", keep_alive=0)).release()
    await asyncio.sleep(0.05)
    assert models.slots["a"].state == "unloaded" and log == ["start a", "stop a"]
