"""Settings: precedence default < file < env < flag, sources, aliases, and error messages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from engine.library.llm import build_settings
from engine.settings import FIELDS, Settings, SettingsError, load_settings

REPO = Path(__file__).resolve().parents[2]


def write_toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "engine.toml"
    path.write_text(text)
    return str(path)


def test_defaults_when_nothing_is_given() -> None:
    settings, sources = load_settings([], {})
    assert settings == Settings()
    assert settings.cache.block_size == 16
    assert settings.server.host == "127.0.0.1" and settings.server.port == 8000
    assert settings.model.path is None
    assert set(sources.values()) == {"default"}
    assert set(sources) == set(FIELDS)


def test_each_layer_overrides_the_one_below(tmp_path: Path) -> None:
    config = write_toml(
        tmp_path,
        "[scheduler]\nmax_num_seqs = 3\nmax_num_batched_tokens = 300\nmax_queued_samples = 30\n"
        "[cache]\nblock_size = 32\n",
    )
    environ = {
        "ENGINE_SCHEDULER__MAX_NUM_BATCHED_TOKENS": "400",
        "ENGINE_SCHEDULER__MAX_QUEUED_SAMPLES": "40",
    }
    argv = ["--config", config, "--scheduler.max_queued_samples", "50"]
    settings, sources = load_settings(argv, environ)
    assert settings.scheduler.max_num_seqs == 3 and sources["scheduler.max_num_seqs"] == "file"
    assert settings.scheduler.max_num_batched_tokens == 400
    assert sources["scheduler.max_num_batched_tokens"] == "env"
    assert settings.scheduler.max_queued_samples == 50
    assert sources["scheduler.max_queued_samples"] == "flag"
    assert settings.cache.block_size == 32 and sources["cache.block_size"] == "file"
    assert sources["model.seed"] == "default"


def test_vllm_style_aliases_reach_their_settings() -> None:
    argv = [
        "--model=/ckpt",
        "--served-model-name",
        "tiny",
        "--tp",
        "2",
        "-dp",
        "3",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "7",
        "--max-num-batched-tokens",
        "99",
        "--block-size",
        "8",
        "--dtype",
        "bfloat16",
        "--api-key",
        "secret",
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        "--no-enable-prefix-caching",
    ]
    s, sources = load_settings(argv, {})
    assert (s.model.path, s.model.served_name, s.model.max_model_len) == ("/ckpt", ("tiny",), 512)
    assert (s.parallel.tensor_parallel_size, s.parallel.data_parallel_size) == (2, 3)
    assert (s.scheduler.max_num_seqs, s.scheduler.max_num_batched_tokens) == (7, 99)
    assert (s.cache.block_size, s.model.dtype, s.server.api_key) == (8, "bfloat16", "secret")
    assert (s.server.host, s.server.port) == ("0.0.0.0", 0)
    assert s.cache.enable_prefix_caching is False
    assert sources["parallel.data_parallel_size"] == "flag"


def test_every_setting_is_reachable_as_section_dot_field(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("a-key")
    key_file.chmod(0o600)
    for key, spec in FIELDS.items():
        if spec.kind == "bool":
            text = "false" if spec.default else "true"
        elif spec.kind == "choice":
            others = [c for c in spec.choices if c != spec.default]
            if not others:
                continue  # one allowed value (cache.kv_cache_dtype): nothing else to set
            text = others[0]
        elif spec.kind == "str":
            text = "value-for-test"
            if key == "model.pooler_config":  # checked at load: vLLM's JSON
                text = '{"pooling_type": "MEAN"}'
            if key == "model.override_generation_config":  # checked at load: vLLM's JSON
                text = '{"temperature": 0.5}'
            if key == "server.api_key_file":  # read at load
                text = str(key_file)
            if key == "models.keep_alive":  # checked at load: Ollama's duration
                text = "10m"
        elif spec.kind == "list":
            text = "a=/adapters/a,b=/adapters/b" if key == "lora.lora_modules" else "a,b"
        elif spec.kind == "int":
            text = str(int(spec.le) if spec.le is not None and spec.le != spec.default else 7)
            if key == "scheduler.max_num_batched_tokens":  # must cover max_num_seqs (256)
                text = "4096"
        else:
            text = "0.25" if spec.default == 0.5 else "0.5"  # unlike the default, and valid
            text = "50" if key == "runtime.heartbeat_timeout" else text
        # One-launch P/D needs both replica counts.
        partner = {
            "kv_transfer.prefill_replicas": ["--kv_transfer.decode_replicas", "1"],
            "kv_transfer.decode_replicas": ["--kv_transfer.prefill_replicas", "1"],
            "lora.lora_modules": ["--enable-lora"],  # adapters need LoRA on
        }.get(key, [])
        settings, sources = load_settings([f"--{key}", text, *partner], {})
        value = msgspec.to_builtins(settings)[spec.section][spec.name]
        assert value != spec.default, key
        assert sources[key] == "flag"


def test_positional_model_path_and_bool_flag_forms() -> None:
    s, _ = load_settings(["/models/x", "--cache.enable_prefix_caching", "false"], {})
    assert s.model.path == "/models/x" and s.cache.enable_prefix_caching is False
    s, _ = load_settings(["--cache.enable-prefix-caching", "--port", "1"], {})
    assert s.cache.enable_prefix_caching is True and s.server.port == 1


def test_byte_sizes_accept_units_everywhere(tmp_path: Path) -> None:
    config = write_toml(tmp_path, '[cache]\nkv_cache_memory = "512MiB"\n')
    s, _ = load_settings(["--config", config], {"ENGINE_SERVER__MAX_REQUEST_BYTES": "2KiB"})
    assert s.cache.kv_cache_memory == 512 * 1024 * 1024
    assert s.server.max_request_bytes == 2048
    s, _ = load_settings(["--kv-cache-memory", "1.5GB"], {})
    assert s.cache.kv_cache_memory == 1_500_000_000


def test_short_env_aliases_and_explicit_form_wins() -> None:
    s, sources = load_settings([], {"ENGINE_API_KEY": "a", "ENGINE_HOME": "/tmp/h"})
    assert s.server.api_key == "a" and sources["server.api_key"] == "env"
    assert s.runtime.engine_home == "/tmp/h"
    s, _ = load_settings([], {"ENGINE_API_KEY": "a", "ENGINE_SERVER__API_KEY": "b"})
    assert s.server.api_key == "b"


def test_unrelated_engine_env_vars_are_ignored_and_none_unsets() -> None:
    environ = {"ENGINE_SOMETHING": "x", "ENGINE_OTHER__THING": "y", "ENGINE_MODEL__PATH": ""}
    s, sources = load_settings(["--max-model-len", "none"], environ)
    assert s.model.path is None and sources["model.path"] == "env"
    assert s.model.max_model_len is None


def test_config_file_from_environment(tmp_path: Path) -> None:
    config = write_toml(tmp_path, "[server]\nport = 1234\n")
    s, sources = load_settings([], {"ENGINE_CONFIG": config})
    assert s.server.port == 1234 and sources["server.port"] == "file"


@pytest.mark.parametrize(
    ("argv", "environ", "fragments"),
    [
        (["--port", "70000"], {}, ["server.port", "--port", "[0, 65535]", "'70000'"]),
        (["--max-num-seqs", "0"], {}, ["scheduler.max_num_seqs", ">= 1", "'0'"]),
        (["--block-size", "x"], {}, ["cache.block_size", "integer in [1, 1024]"]),
        (["--kv-cache-fraction", "1.5"], {}, ["cache.kv_cache_fraction", "(0, 1]"]),
        (["--dtype", "fp7"], {}, ["model.dtype", "one of", "float16", "'fp7'"]),
        (["--log-level", "loud"], {}, ["runtime.log_level", "one of", "debug"]),
        (["--drain-timeout", "-1"], {}, ["server.drain_timeout", ">= 0"]),
        (["--port"], {}, ["server.port", "needs a value"]),
        (["--bogus", "1"], {}, ["unknown flag --bogus"]),
        (["--model.nope", "1"], {}, ["unknown flag --model.nope"]),
        (["a", "b"], {}, ["unexpected argument 'b'"]),
        ([], {"ENGINE_CACHE__BLOCK_SIZE": "0"}, ["cache.block_size", "ENGINE_CACHE__BLOCK_SIZE"]),
        ([], {"ENGINE_CACHE__BLOK_SIZE": "8"}, ["unknown setting cache.blok_size", "block_size"]),
        ([], {"ENGINE_CACHE__ENABLE_PREFIX_CACHING": "maybe"}, ["true or false", "'maybe'"]),
        (["--max-request-bytes", "3 parsecs"], {}, ["server.max_request_bytes", "byte count"]),
        (
            ["--runtime.heartbeat_interval", "5", "--runtime.heartbeat_timeout", "2"],
            {},
            ["runtime.heartbeat_timeout", "greater than runtime.heartbeat_interval"],
        ),
    ],
)
def test_invalid_values_name_the_setting_and_allowed_form(
    argv: list[str], environ: dict[str, str], fragments: list[str]
) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(argv, environ)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("[scheduler]\nmax_num_seqs = 0\n", ["scheduler.max_num_seqs", "config file", ">= 1"]),
        ("[scheduler]\nmax_num_seqs = '4'\n", ["scheduler.max_num_seqs", "'4'"]),
        ("[cache]\nblock_size = true\n", ["cache.block_size", "True"]),
        ("[scheduler]\nmax_num_seq = 4\n", ["unknown setting scheduler.max_num_seq"]),
        ("[schedular]\nmax_num_seqs = 4\n", ["unknown section [schedular]", "scheduler"]),
        ("[scheduler\n", ["not valid TOML"]),
    ],
)
def test_invalid_config_files_are_named(tmp_path: Path, text: str, fragments: list[str]) -> None:
    config = write_toml(tmp_path, text)
    with pytest.raises(SettingsError) as info:
        load_settings(["--config", config], {})
    for fragment in fragments:
        assert fragment in str(info.value)


def test_missing_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"cannot read config file .*missing\.toml"):
        load_settings(["--config", str(tmp_path / "missing.toml")], {})


def test_settings_travel_as_msgpack() -> None:
    settings, _ = load_settings(["--tp", "2", "--kv-cache-memory", "1MiB"], {})
    wire = msgspec.msgpack.encode(settings)
    assert msgspec.msgpack.decode(wire, type=Settings) == settings


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
        timeout=60,
    )


def test_config_show_prints_values_and_sources(tmp_path: Path) -> None:
    config = write_toml(tmp_path, "[cache]\nblock_size = 32\n")
    env = {"ENGINE_SCHEDULER__MAX_NUM_SEQS": "9", "ENGINE_API_KEY": "hunter2"}
    proc = run_cli("config", "show", "--config", config, "--port", "8123", env=env)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()[1:]}
    assert rows["cache.block_size"] == ["32", "file"]
    assert rows["scheduler.max_num_seqs"] == ["9", "env"]
    assert rows["server.port"] == ["8123", "flag"]
    assert rows["model.seed"] == ["0", "default"]
    assert rows["server.api_key"] == ["***", "env"]
    assert "hunter2" not in proc.stdout


def test_config_show_json() -> None:
    proc = run_cli("config", "show", "--json", "--tp", "2")
    assert proc.returncode == 0, proc.stderr
    shown = msgspec.json.decode(proc.stdout)
    assert shown["parallel.tensor_parallel_size"] == {"value": 2, "source": "flag"}
    assert shown["model.max_model_len"] == {"value": None, "source": "default"}


def test_cli_rejects_invalid_value_with_one_line_and_nonzero_exit() -> None:
    proc = run_cli("serve", "--max-num-seqs", "-3")
    assert proc.returncode != 0
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "scheduler.max_num_seqs" in lines[0] and ">= 1" in lines[0]


def test_help_lists_every_setting() -> None:
    proc = run_cli("--help")
    assert proc.returncode == 0
    for spec in FIELDS.values():
        assert spec.flag in proc.stdout
        assert spec.env_var in proc.stdout
    assert "--tensor-parallel-size" in proc.stdout and "--tp" in proc.stdout


def test_a_step_budget_below_the_running_sequences_is_refused_on_every_path() -> None:
    # With fewer tokens per step than running sequences, the later ones would starve.
    argv = ["--max-num-seqs", "64", "--max-num-batched-tokens", "32"]
    with pytest.raises(SettingsError) as cli:
        load_settings(argv, {})
    message = str(cli.value)
    assert "scheduler.max_num_batched_tokens (flag)" in message
    assert "max_num_seqs (64)" in message and "got 32" in message
    with pytest.raises(ValueError, match=r"max_num_batched_tokens: .*\(64\).*got 32"):
        build_settings(**{"scheduler.max_num_seqs": 64, "scheduler.max_num_batched_tokens": 32})


@pytest.mark.parametrize(
    ("flags", "named", "says"),
    [
        (["--prefill-replicas", "1"], "kv_transfer.decode_replicas", "needs both roles"),
        (["--decode-replicas", "2"], "kv_transfer.prefill_replicas", "needs both roles"),
        (
            ["--prefill-replicas", "1", "--decode-replicas", "1", "--kv-role", "decode"],
            "kv_transfer.role",
            "one launch runs both roles",
        ),
        (
            ["--prefill-replicas", "1", "--decode-replicas", "1", "--dp", "2"],
            "parallel.data_parallel_size",
            "they set the replicas",
        ),
        (["--kv-role", "prefill", "--nnodes", "2"], "parallel.nnodes", "on one host"),
        (
            ["--kv-role", "decode", "--enable-prefix-caching", "false"],
            "cache.enable_prefix_caching",
            "prefix cache",
        ),
    ],
)
def test_invalid_pd_combinations_fail_naming_the_setting(
    flags: list[str], named: str, says: str
) -> None:
    with pytest.raises(SettingsError) as raised:
        load_settings(flags, {})
    message = str(raised.value)
    assert "\n" not in message and named in message and says in message, message


def test_pd_flags_reach_their_settings() -> None:
    s, _ = load_settings(
        [
            "--kv-role",
            "prefill",
            "--kv-transfer-port",
            "7100",
            "--kv-hold-timeout",
            "5",
            "--kv-transfer-host",
            "0.0.0.0",
            "--kv-transfer-advertise-host",
            "10.0.0.2",
        ],
        {},
    )
    kv = s.kv_transfer
    assert (kv.role, kv.port, kv.hold_timeout) == ("prefill", 7100, 5.0)
    assert (kv.host, kv.advertise_host) == ("0.0.0.0", "10.0.0.2")


def test_the_api_key_comes_from_a_file_only_its_owner_can_write(tmp_path: Path) -> None:
    """A key on the command line is readable by every local user (/proc/<pid>/cmdline): a file
    (or ENGINE_API_KEY) keeps it from them."""
    key_file = tmp_path / "key"
    key_file.write_text("s3cret-key\n")
    key_file.chmod(0o600)
    settings, _ = load_settings(["--api-key-file", str(key_file)], {})
    assert settings.server.api_key == "s3cret-key"
    settings, sources = load_settings([], {"ENGINE_API_KEY": "from-env"})
    assert settings.server.api_key == "from-env" and sources["server.api_key"] == "env"
    key_file.chmod(0o622)
    with pytest.raises(SettingsError, match="writable by other users"):
        load_settings(["--api-key-file", str(key_file)], {})
    with pytest.raises(SettingsError, match="give the API key one way"):
        load_settings(["--api-key", "x", "--api-key-file", str(key_file)], {})
