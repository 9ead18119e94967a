"""The command line as a vLLM user types it (issue 16): the `engine` console script, vLLM's
flags and size suffixes, one line for an unknown flag, a model given as a Hugging Face repo id
found in the local cache (the sampling defaults: tests/unit/test_sampling_defaults.py)."""

from __future__ import annotations

import importlib
import sys
import tomllib
from pathlib import Path

import pytest

from engine.cli import main
from engine.launch.hf_cache import resolve_model, with_resolved_model
from engine.settings import SettingsError, load_settings

REPO = Path(__file__).resolve().parents[2]


def one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(
    ("flag", "close"),
    [
        ("--max-model-lenn", "--max-model-len"),
        ("--served-model", "--served-model-name"),
        ("--enable-log-request", "--enable-log-requests"),
        ("--tensor-paralel-size", "--tensor-parallel-size"),
        ("--wholly-unknown-thing", None),
    ],
)
def test_each_unknown_flag_is_one_line_naming_it_and_close_matches(
    capsys: pytest.CaptureFixture[str], flag: str, close: str | None
) -> None:
    err = one_error_line(capsys, ["serve", "some/model-dir", flag, "1"])
    assert f"unknown flag {flag}" in err
    if close is not None:
        assert close in err.split("did you mean", 1)[1]
    else:
        assert "did you mean" not in err


def test_console_script_runs_the_same_main(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["engine"].partition(":")
    entry = getattr(importlib.import_module(module), function)
    monkeypatch.setattr(sys, "argv", ["engine", "serve", "org/model", "--no-such-flag"])
    assert entry() == 2
    assert "unknown flag --no-such-flag" in capsys.readouterr().err


def test_vllm_flags_reach_their_settings(tmp_path: Path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages }}")
    s, sources = load_settings(
        [
            "/models/x",
            "--served-model-name",
            "first",
            "second",
            "--chat-template",
            str(template),
            "--max-logprobs",
            "5",
            "--generation-config",
            "vllm",
            "--enforce-eager",
            "--kv-cache-dtype",
            "auto",
            "--enable-log-requests",
            "--disable-log-stats",
            "--max-log-len",
            "100",
            "--allowed-origins",
            '["https://a.example", "https://b.example"]',
            "--allowed-methods",
            "GET,POST",
            "--root-path",
            "/api",
            "--uds",
            "/tmp/engine.sock",
        ],
        {},
    )
    assert s.model.path == "/models/x"
    assert s.model.served_name == ("first", "second")
    assert s.model.chat_template == str(template) and s.model.max_logprobs == 5
    assert s.model.generation_config == "vllm" and s.model.enforce_eager is True
    assert s.server.enable_log_requests and s.server.disable_log_stats
    assert s.server.max_log_len == 100
    assert s.server.allowed_origins == ("https://a.example", "https://b.example")
    assert s.server.allowed_methods == ("GET", "POST")
    assert (s.server.root_path, s.server.uds) == ("/api", "/tmp/engine.sock")
    assert sources["model.served_name"] == "flag"


def test_served_names_from_env_and_toml(tmp_path: Path) -> None:
    s, _ = load_settings([], {"ENGINE_MODEL__SERVED_NAME": "a,b"})
    assert s.model.served_name == ("a", "b")
    config = tmp_path / "c.toml"
    config.write_text('[model]\nserved_name = "only"\n')
    s, _ = load_settings(["--config", str(config)], {})
    assert s.model.served_name == ("only",)


@pytest.mark.parametrize(
    ("text", "value"),
    [("32k", 32_000), ("32K", 32_768), ("1.5k", 1_500), ("2m", 2_000_000), ("1M", 1 << 20)],
)
def test_size_suffixes_read_as_vllm_reads_them(text: str, value: int) -> None:
    s, _ = load_settings(["--max-model-len", text], {})
    assert s.model.max_model_len == value


def test_a_decimal_with_a_binary_suffix_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = one_error_line(capsys, ["config", "show", "--max-model-len", "25.6K"])
    assert "--max-model-len" in err and "25.6K" in err


def test_unsupported_kv_cache_dtype_names_what_is_supported(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = one_error_line(capsys, ["config", "show", "--kv-cache-dtype", "fp8"])
    assert "cache.kv_cache_dtype" in err and "auto" in err and "fp8" in err


def fake_hub(root: Path, repo_id: str, revision: str = "0123abcd") -> Path:
    """The layout huggingface_hub leaves: models--org--name/{refs/main, snapshots/<rev>/}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision + "\n")
    return snapshot


def test_repo_id_resolves_from_the_hf_cache(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    snapshot = fake_hub(hub, "org/tiny-model")
    fake_hub(hub, "org/other-model", revision="ffff")
    assert resolve_model("org/tiny-model", {"HF_HUB_CACHE": str(hub)}) == str(snapshot)
    assert resolve_model("org/tiny-model", {"HF_HOME": str(tmp_path)}) == str(snapshot)
    settings, _ = load_settings(["org/tiny-model"], {})
    resolved = with_resolved_model(settings, {"HF_HUB_CACHE": str(hub)})
    assert resolved.model.path == str(snapshot)
    assert resolved.model.served_name == ("org/tiny-model",)  # clients still use the id


def test_local_directories_are_not_looked_up(tmp_path: Path) -> None:
    local = tmp_path / "org" / "name"
    local.mkdir(parents=True)
    assert resolve_model(str(local), {"HF_HUB_CACHE": str(tmp_path)}) is None
    assert resolve_model("./relative/dir", {"HF_HUB_CACHE": str(tmp_path)}) is None


def test_a_repo_id_not_in_the_cache_is_one_line_naming_it_and_the_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = tmp_path / "hub"
    fake_hub(hub, "org/present")
    with pytest.raises(SettingsError) as caught:
        resolve_model("org/absent", {"HF_HUB_CACHE": str(hub)})
    assert "org/absent" in str(caught.value) and str(hub) in str(caught.value)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    err = one_error_line(capsys, ["serve", "org/absent"])
    assert "org/absent" in err and str(hub) in err
