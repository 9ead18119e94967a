"""vLLM's LoRA flags as the command line gives them: --lora-modules as name=path words or as
vLLM's JSON object, and the combinations refused in one line."""

from __future__ import annotations

import json

import pytest

from engine.settings import SettingsError, load_settings
from engine.settings.lora_schema import LoraModule, parse_lora_module


def test_lora_modules_take_name_path_words_and_vllms_json_form() -> None:
    as_json = json.dumps({"name": "b", "path": "/adapters/b", "base_model_name": "base"})
    argv = ["--enable-lora", "--lora-modules", "a=/adapters/a", as_json, "--max-loras", "3"]
    settings, sources = load_settings(argv, {})
    lora = settings.lora
    assert [parse_lora_module(text) for text in lora.lora_modules] == [
        LoraModule("a", "/adapters/a"),
        LoraModule("b", "/adapters/b", "base"),
    ]
    assert (lora.enable_lora, lora.max_loras, lora.max_lora_rank) == (True, 3, 16)
    assert lora.cache_size() == 3 and sources["lora.lora_modules"] == "flag"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora-modules", "a=/x"], "needs lora.enable_lora"),
        (["--enable-lora", "--lora-modules", "a"], "'a' is not name=path"),
        (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "names adapter 'a' twice"),
        (["--enable-lora", "--lora-modules", '{"name": "a"}'], "is not a valid LoRA module"),
        (["--enable-lora", "--tp", "2"], "not supported with tensor parallelism"),
        (["--enable-lora", "--kv-role", "prefill"], "not supported with P/D disaggregation"),
        (["--max-lora-rank", "0"], r"expected an integer in \[1, 1024\], got '0'"),
    ],
)
def test_lora_settings_that_cannot_work_are_refused_in_one_line(
    argv: list[str], message: str
) -> None:
    with pytest.raises(SettingsError, match=message) as refused:
        load_settings(argv, {})
    assert "\n" not in str(refused.value)
