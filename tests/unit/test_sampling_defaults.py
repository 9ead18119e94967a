"""What a request gets for the sampling fields it leaves unset (issue 47): a model without
defaults of its own gets llama.cpp's, not vLLM's temperature 1.0; a model with its own keeps vLLM's
`--generation-config` rule; `--override-generation-config` merges over either; `config show`
and the start log say which, and where a request without max_tokens stops."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.cli import main
from engine.http.openai.parsing import parse_chat
from engine.messages.params import SamplingParams
from engine.messages.requests import EngineRequest
from engine.request.defaults import load_sampling_defaults
from engine.request.outputs import EngineError
from engine.request.policy import RequestPolicy
from engine.request.prompts import library_request
from engine.settings import load_settings
from tests.checkpoints import tiny_checkpoint
from tests.gguf_files import gguf_of

# llama.cpp's common_params_sampling (temperature, top-k, top-p, min-p) and Ollama's repeat
# penalty with its window: the numbers users of either know.
LLAMA_CPP = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "repeat_last_n": 64,
}


def model_dir(tmp_path: Path, generation_config: dict[str, object]) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return tmp_path


def prepared(
    policy: RequestPolicy, params: SamplingParams | None, defaulted: set[str] | None = None
) -> EngineRequest:
    """The library's request for "hi" through `policy`; `defaulted`: a front end's unset fields."""
    request = library_request("hi", params)
    if defaulted is not None:
        request.defaulted_fields = frozenset(defaulted)
    policy.apply(request)
    return request


def test_a_model_without_sampling_defaults_gets_llama_cpps(tmp_path: Path) -> None:
    folder = model_dir(tmp_path, {"eos_token_id": [2], "max_new_tokens": 300})
    defaults = load_sampling_defaults("auto", str(folder))
    assert defaults.values == {**LLAMA_CPP, "max_tokens": 300}  # the model's own bound stays
    assert "llama.cpp" in defaults.origin
    assert load_sampling_defaults("auto", str(tmp_path / "absent")).values == LLAMA_CPP
    # What a request that sets nothing samples with; its own fields win.
    settings, _ = load_settings([], {})
    policy = RequestPolicy.load(settings, str(folder), max_model_len=512)
    assert prepared(policy, None).params == SamplingParams(**LLAMA_CPP, max_tokens=300)  # type: ignore[arg-type]
    own = prepared(policy, SamplingParams(temperature=0.5), {"top_k"})
    assert (own.params.temperature, own.params.top_k, own.params.top_p) == (0.5, 40, 1.0)
    # A request that asks for greedy decoding stays greedy (as in vLLM): only the bound applies.
    every = {"top_k", "min_p", "repetition_penalty", "repeat_last_n", "max_tokens"}
    greedy = prepared(policy, SamplingParams(temperature=0.0), every)
    assert greedy.params == SamplingParams(temperature=0.0, max_tokens=300)


def test_an_api_request_takes_the_defaults_for_the_fields_it_leaves_unset(tmp_path: Path) -> None:
    settings, _ = load_settings([], {})
    policy = RequestPolicy.load(settings, str(tmp_path), max_model_len=512)

    def sampled(**fields: object) -> SamplingParams:
        body = {"messages": [{"role": "user", "content": "hi"}], **fields}
        [request] = parse_chat(json.dumps(body).encode(), "m").requests
        policy.apply(request)
        return request.params

    assert sampled() == SamplingParams(**LLAMA_CPP, max_tokens=None)  # type: ignore[arg-type]
    own = sampled(temperature=0.5, repetition_penalty=1.3, repeat_last_n=8)
    assert (own.temperature, own.repetition_penalty, own.repeat_last_n, own.top_k) == (
        0.5,
        1.3,
        8,
        40,
    )
    assert sampled(temperature=0) == SamplingParams(temperature=0, max_tokens=None)
    with pytest.raises(EngineError, match="repeat_last_n must be an integer >= 1"):
        sampled(repeat_last_n=0)


def test_a_model_with_its_own_keeps_vllms_rule_and_overrides_merge_over_it(
    tmp_path: Path,
) -> None:
    folder = model_dir(tmp_path, {"temperature": 0.6, "top_k": 20, "do_sample": True})
    assert load_sampling_defaults("auto", str(folder)).values == {"temperature": 0.6, "top_k": 20}
    assert load_sampling_defaults("vllm", str(folder)).values == {}
    assert load_sampling_defaults(str(folder), "/elsewhere").values == {
        "temperature": 0.6,
        "top_k": 20,
    }
    override = '{"temperature": 0.3, "max_new_tokens": 64}'
    merged = load_sampling_defaults("auto", str(folder), override).values
    assert merged == {"temperature": 0.3, "top_k": 20, "max_tokens": 64}
    only = load_sampling_defaults("vllm", str(folder), override).values
    assert only == {"temperature": 0.3, "max_tokens": 64}
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['temp'\]"):
        load_sampling_defaults("auto", str(folder), '{"temp": 0.3}')
    with pytest.raises(ValueError, match="top_p must be a number in"):
        load_sampling_defaults("auto", str(folder), '{"top_p": 2}')
    with pytest.raises(ValueError, match=r"no generation_config\.json"):
        load_sampling_defaults(str(tmp_path / "missing"), "/elsewhere")


def test_a_bad_override_stops_the_start_in_one_line_before_anything_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--model", "demo", "--override-generation-config", '{"top_p": 2}']) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.override_generation_config" in err, err
    assert "top_p must be a number in (0, 1], got 2" in err


def test_config_show_states_the_defaults_and_the_output_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The default model's file carries no sampling defaults: llama.cpp's are shown.
    assert main(["config", "show"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("sampling defaults: temperature=0.8, top_k=40, top_p=0.95, min_p=0.05")
    assert line.endswith("max_tokens unset: 2048 (limits.default_max_tokens)")
    folder = model_dir(tmp_path, {"top_p": 0.8})
    assert main(["config", "show", str(folder), "--default-max-tokens", "0", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["generation_defaults"]["value"] == {"top_p": 0.8}
    assert shown["limits.default_max_tokens"] == {"value": 0, "source": "flag"}


def test_a_gguf_files_own_sampling_metadata_is_the_models_defaults(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """llama.cpp's general.sampling.* keys, as llama-server applies them."""
    metadata = {
        "general.sampling.temp": 0.6,
        "general.sampling.top_k": 20,
        "general.sampling.penalty_last_n": 32,
    }
    gguf_file, _ = gguf_of(tiny_checkpoint("llama"), "Q8_0", **metadata)
    assert main(["config", "show", str(gguf_file), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["generation_defaults"]
    assert shown["value"] == {"temperature": 0.6, "top_k": 20, "repeat_last_n": 32}
