"""Build `Settings` from defaults < TOML file < environment < command-line flags.

Every value is checked where it enters (so the error can say where it came from), then the
sections are assembled and cross-field rules checked. Errors are `SettingsError`: one line that
names the setting, its source, the value given and the allowed form.
"""

from __future__ import annotations

import difflib
import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from engine.settings.api_key import ApiKeyFileError, read_api_key_file
from engine.settings.fields import _FALSE, _TRUE, FIELDS, FieldSpec
from engine.settings.schema import SECTIONS, Settings, cross_field_problems

ENV_PREFIX = "ENGINE_"
CONFIG_ENV = "ENGINE_CONFIG"

# Short environment names people expect; the ENGINE_SECTION__FIELD form wins over these.
ENV_ALIASES: dict[str, str] = {
    "ENGINE_API_KEY": "server.api_key",
    "ENGINE_HOME": "runtime.engine_home",
}

# vLLM-style flags → setting. Every setting is also reachable as --section.field.
FLAG_ALIASES: dict[str, str] = {
    "--model": "model.path",
    "--served-model-name": "model.served_name",
    "--tokenizer": "model.tokenizer",
    "--dtype": "model.dtype",
    "--device": "model.device",
    "--kernel-backend": "model.kernel_backend",
    "--quantization": "model.quantization",
    "-q": "model.quantization",
    "--max-model-len": "model.max_model_len",
    "--seed": "model.seed",
    "--block-size": "cache.block_size",
    "--kv-cache-memory": "cache.kv_cache_memory",
    "--kv-cache-fraction": "cache.kv_cache_fraction",
    "--gpu-memory-utilization": "cache.kv_cache_fraction",
    "--enable-prefix-caching": "cache.enable_prefix_caching",
    "--max-num-seqs": "scheduler.max_num_seqs",
    "--max-num-batched-tokens": "scheduler.max_num_batched_tokens",
    "--max-queued-samples": "scheduler.max_queued_samples",
    "--speculative-config": "scheduler.speculative_config",
    "--enable-lora": "lora.enable_lora",
    "--lora-modules": "lora.lora_modules",
    "--lora-path-allow": "lora.lora_path_allow",
    "--max-loras": "lora.max_loras",
    "--max-lora-rank": "lora.max_lora_rank",
    "--max-cpu-loras": "lora.max_cpu_loras",
    "--tensor-parallel-size": "parallel.tensor_parallel_size",
    "--tp": "parallel.tensor_parallel_size",
    "-tp": "parallel.tensor_parallel_size",
    "--data-parallel-size": "parallel.data_parallel_size",
    "--dp": "parallel.data_parallel_size",
    "-dp": "parallel.data_parallel_size",
    "--nnodes": "parallel.nnodes",
    "--node-rank": "parallel.node_rank",
    "--master-addr": "parallel.master_addr",
    "--master-port": "parallel.master_port",
    "--collective-timeout": "parallel.collective_timeout",
    "--deterministic": "model.deterministic",
    "--kv-role": "kv_transfer.role",
    "--prefill-replicas": "kv_transfer.prefill_replicas",
    "--decode-replicas": "kv_transfer.decode_replicas",
    "--kv-transfer-host": "kv_transfer.host",
    "--kv-transfer-port": "kv_transfer.port",
    "--kv-transfer-advertise-host": "kv_transfer.advertise_host",
    "--kv-hold-timeout": "kv_transfer.hold_timeout",
    "--kv-transport": "kv_transfer.transport",
    "--host": "server.host",
    "--port": "server.port",
    "--api-key": "server.api_key",
    "--api-key-file": "server.api_key_file",
    "--api-keys-file": "server.api_keys_file",
    "--max-request-bytes": "server.max_request_bytes",
    "--drain-timeout": "server.drain_timeout",
    "--record-trace": "server.record_trace",
    "--tool-call-parser": "server.tool_call_parser",
    "--reasoning-parser": "server.reasoning_parser",
    "--otlp-traces-endpoint": "server.otlp_traces_endpoint",
    "--ui": "server.ui",  # --no-ui turns the chat page off
    "--admin-socket": "admin.socket",
    "--chat-template": "model.chat_template",
    "--generation-config": "model.generation_config",
    "--override-generation-config": "model.override_generation_config",
    "--default-max-tokens": "limits.default_max_tokens",
    "--max-logprobs": "model.max_logprobs",
    "--pooler-config": "model.pooler_config",
    "--override-pooler-config": "model.pooler_config",
    "--enforce-eager": "model.enforce_eager",
    "--kv-cache-dtype": "cache.kv_cache_dtype",
    "--kv-disk": "cache.kv_disk",  # --no-kv-disk turns the prefix cache's disk tier off
    "--kv-disk-path": "cache.kv_disk_path",
    "--kv-disk-size": "cache.kv_disk_size",
    "--uds": "server.uds",
    "--pidfile": "server.pidfile",
    "--root-path": "server.root_path",
    "--enable-log-requests": "server.enable_log_requests",
    "--max-log-len": "server.max_log_len",
    "--disable-log-stats": "server.disable_log_stats",
    "--allowed-origins": "server.allowed_origins",
    "--allowed-methods": "server.allowed_methods",
    "--allowed-headers": "server.allowed_headers",
    "--allow-credentials": "server.allow_credentials",
    "--log-level": "runtime.log_level",
    "--engine-home": "runtime.engine_home",
    # many models in one server (llama-server's router mode, Ollama's keep_alive)
    "--models-dir": "models.dir",
    "--keep-alive": "models.keep_alive",
    "--max-loaded-models": "models.max_loaded",
    "--models-max": "models.max_loaded",
    "--models-memory": "models.memory",
}

Sources = dict[str, str]  # "section.field" → "default" | "file" | "env" | "flag"


class SettingsError(ValueError):
    """An invalid or unknown setting; the message is one line, fit to print as is."""


def load_settings(argv: list[str], environ: Mapping[str, str]) -> tuple[Settings, Sources]:
    """Effective settings for these flags and this environment, and where each value came from.

    `argv` holds only settings flags (no program name, no subcommand): `--config FILE`, the
    aliases above, `--section.field VALUE`, and at most one positional, the model path.
    """
    values: dict[str, Any] = {key: spec.default for key, spec in FIELDS.items()}
    sources: Sources = dict.fromkeys(FIELDS, "default")
    flags, config_path = _parse_flags(argv)
    if config_path is None and environ.get(CONFIG_ENV):
        config_path = environ[CONFIG_ENV]
    layers: list[tuple[str, dict[str, Any]]] = []
    if config_path is not None:
        layers.append(("file", _read_toml(config_path)))
    layers.append(("env", _read_env(environ)))
    layers.append(("flag", flags))
    for source, layer in layers:
        for key, value in layer.items():
            values[key] = value
            sources[key] = source
    settings = _assemble(values)
    _check_cross_field(settings, sources)
    return _with_key_from_file(settings), sources


def _with_key_from_file(settings: Settings) -> Settings:
    """server.api_key read from server.api_key_file, when that is set."""
    path = settings.server.api_key_file
    if path is None:
        return settings
    try:
        key = read_api_key_file(path)
    except ApiKeyFileError as exc:
        raise SettingsError(f"invalid setting server.api_key_file: {exc}") from None
    server = msgspec.structs.replace(settings.server, api_key=key)
    return msgspec.structs.replace(settings, server=server)


def _fail(spec: FieldSpec, where: str, problem: str) -> SettingsError:
    return SettingsError(f"invalid setting {spec.key} ({where}): {problem}")


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise SettingsError(f"cannot read config file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"config file {path} is not valid TOML: {e}") from None
    out: dict[str, Any] = {}
    for section, table in data.items():
        if section not in SECTIONS:
            raise SettingsError(
                f"unknown section [{section}] in config file {path}; "
                f"known sections: {', '.join(SECTIONS)}"
            )
        if not isinstance(table, dict):
            raise SettingsError(f"config file {path}: '{section}' must be a [{section}] table")
        for name, value in table.items():
            spec = _lookup(section, name, f"in config file {path}")
            try:
                out[spec.key] = spec.check(value)
            except ValueError as e:
                raise _fail(spec, f"config file {path}", str(e)) from None
    return out


def _read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    explicit: set[str] = set()
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX) or "__" not in var:
            continue
        section, _, name = var[len(ENV_PREFIX) :].lower().partition("__")
        if section not in SECTIONS:
            continue  # not ours: other tools may use ENGINE_* names
        spec = _lookup(section, name, f"in environment variable {var}")
        try:
            out[spec.key] = spec.parse_text(environ[var])
        except ValueError as e:
            raise _fail(spec, f"env {var}", str(e)) from None
        explicit.add(spec.key)
    for var, key in ENV_ALIASES.items():
        if var in environ and key not in explicit:
            spec = FIELDS[key]
            try:
                out[key] = spec.parse_text(environ[var])
            except ValueError as e:
                raise _fail(spec, f"env {var}", str(e)) from None
    return out


def _lookup(section: str, name: str, where: str) -> FieldSpec:
    spec = FIELDS.get(f"{section}.{name}")
    if spec is None:
        known = ", ".join(s.name for s in FIELDS.values() if s.section == section)
        raise SettingsError(
            f"unknown setting {section}.{name} {where}; settings of [{section}]: {known}"
        )
    return spec


def _flag_target(flag: str) -> tuple[FieldSpec, bool] | None:
    """The setting a flag names, and whether it is a negated boolean (--no-...)."""
    negated = False
    name = flag
    if name.startswith("--no-"):
        negated, name = True, "--" + name[len("--no-") :]
    if "." in name:
        section, _, field = name.lstrip("-").partition(".")
        spec = FIELDS.get(f"{section}.{field.replace('-', '_')}")
    else:
        key = FLAG_ALIASES.get(name.replace("_", "-"))
        spec = FIELDS[key] if key else None
    if spec is None or (negated and spec.kind != "bool"):
        return None
    return spec, negated


def _parse_flags(argv: list[str]) -> tuple[dict[str, Any], str | None]:
    out: dict[str, Any] = {}
    config_path: str | None = None
    positional_model = False
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("-") or token == "-":
            if positional_model:
                raise SettingsError(f"unexpected argument {token!r}: only one model path allowed")
            spec = FIELDS["model.path"]
            out[spec.key] = spec.parse_text(token)
            positional_model = True
            continue
        flag, has_inline, inline = token.partition("=")
        if flag == "--config":
            if has_inline:
                config_path = inline
            elif i < len(argv):
                config_path, i = argv[i], i + 1
            else:
                raise SettingsError("flag --config needs a value: a TOML file path")
            continue
        target = _flag_target(flag)
        if target is None:
            raise SettingsError(unknown_flag_message(flag))
        spec, negated = target
        if spec.kind == "list" and not has_inline:
            # As vLLM's nargs="+": every word up to the next flag ("--served-model-name a b")
            words = []
            while i < len(argv) and not argv[i].startswith("-"):
                words.append(argv[i])
                i += 1
            if not words:
                raise _fail(spec, f"flag {flag}", f"needs a value: {spec.expected()}")
            text = words[0] if len(words) == 1 else json.dumps(words)
        elif spec.kind == "bool" and not has_inline:
            # A boolean flag alone means true; a following true/false word is its value.
            if i < len(argv) and argv[i].strip().lower() in _TRUE | _FALSE:
                text, i = argv[i], i + 1
            else:
                text = "true"
        elif has_inline:
            text = inline
        elif i < len(argv):
            text, i = argv[i], i + 1
        else:
            raise _fail(spec, f"flag {flag}", f"needs a value: {spec.expected()}")
        try:
            value = spec.parse_text(text)
        except ValueError as e:
            raise _fail(spec, f"flag {flag}", str(e)) from None
        out[spec.key] = (not value) if negated else value
    return out, config_path


def unknown_flag_message(flag: str) -> str:
    """One line naming the flag and the known flags closest to it."""
    known = [*FLAG_ALIASES, *(spec.flag for spec in FIELDS.values()), "--config"]
    close = difflib.get_close_matches(flag.replace("_", "-"), known, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return f"unknown flag {flag}{hint} (see --help; every setting is also --section.field VALUE)"


def _assemble(values: Mapping[str, Any]) -> Settings:
    sections: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        fields = {s.name: values[s.key] for s in FIELDS.values() if s.section == section}
        sections[section] = cls(**fields)
    return Settings(**sections)


def _check_cross_field(settings: Settings, sources: Sources) -> None:
    for key, problem in cross_field_problems(settings):
        raise SettingsError(f"invalid setting {key} ({sources[key]}): {problem}")


def default_settings() -> Settings:
    """The schema's defaults, ignoring environment and files (tests, library use)."""
    return Settings()


def config_file_of(argv: list[str], environ: Mapping[str, str]) -> str | None:
    """The config file these flags/environment name, if any (for `config show`)."""
    _, path = _parse_flags(argv)
    return path if path is not None else (environ.get(CONFIG_ENV) or None)


def resolve_home(settings: Settings) -> Path:
    return Path(settings.runtime.engine_home).expanduser()
