"""The library API over the real actor system: sampling, stops, n > 1, errors, abort."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from engine import LLM, AsyncLLM, EngineError, LoRARequest, RequestOutput, SamplingParams
from engine.library.llm import build_settings
from engine.messages.admin import EngineStats
from tests.checkpoints import hf_greedy, tiny_checkpoint
from tests.holds import held, holding
from tests.lora_adapters import ALL_MODULES, lora_adapter, peft_greedy

PROMPTS = ["the quick brown fox", "a b c d e f g", "hello there, general", "zz"]


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(tiny_checkpoint(arch="qwen3"))


@pytest.fixture(scope="module")
def llm(model_path: str) -> Iterator[LLM]:
    # vLLM's engine argument names, as a vLLM user would write them.
    with LLM(
        model_path,
        kv_cache_memory_bytes=4 * 2**20,
        max_model_len=256,
        max_num_seqs=64,
        max_logprobs=5,
        gpu_memory_utilization=0.5,
        enforce_eager=True,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    ) as engine:
        yield engine


def test_vllm_engine_arguments_reach_the_settings(llm: LLM) -> None:
    settings = llm.engine.settings
    assert settings.scheduler.max_num_seqs == 64 and settings.cache.kv_cache_fraction == 0.5
    assert settings.cache.kv_cache_memory == 4 * 2**20 and settings.model.max_model_len == 256


def test_lora_requests_beside_the_base_model_give_peft_and_transformers_tokens(
    llm: LLM, model_path: str, tmp_path: Path
) -> None:
    """vLLM's LLM.generate(..., lora_request=...), one adapter per prompt, in one batch."""
    base = Path(model_path)
    wide = lora_adapter(base, rank=8, targets=ALL_MODULES, seed=1, use_rslora=True)
    narrow = lora_adapter(base, rank=4, targets=("q_proj", "v_proj"), seed=2, alpha=32)
    prompt = [11, 12, 13, 14, 15, 16, 200, 300, 8]
    loras = [LoRARequest("wide", 1, str(wide)), None, LoRARequest("narrow", 2, str(narrow))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([prompt] * 3, params, use_tqdm=False, lora_request=loras)
    tokens = [output.outputs[0].token_ids for output in outputs]
    assert tokens[0] == peft_greedy(base, wide, prompt, 8)[0]
    assert tokens[1] == hf_greedy(base, prompt, 8)[0]
    assert tokens[2] == peft_greedy(base, narrow, prompt, 8)[0]
    (tmp_path / "adapter_config.json").write_text('{"r": 64, "target_modules": ["q_proj"]}')
    with pytest.raises(EngineError, match=r"its rank \(r\) exceeds --max-lora-rank 8"):
        llm.generate("hi", params, use_tqdm=False, lora_request=LoRARequest("x", 3, str(tmp_path)))


def test_an_unknown_engine_argument_is_a_type_error_naming_it_and_close_matches() -> None:
    with pytest.raises(TypeError, match=r"'max_num_seq'.*did you mean max_num_seqs"):
        LLM("unused", max_num_seq=4)
    with pytest.raises(TypeError, match="'speculative_model'"):
        LLM("unused", speculative_model="x")


def test_prompt_dicts_and_token_ids_give_what_text_gives(llm: LLM) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (text,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    as_dicts = llm.generate(
        [{"prompt": PROMPTS[0]}, {"prompt_token_ids": text.prompt_token_ids}], params
    )
    for out in as_dicts:
        assert out.outputs[0].token_ids == text.outputs[0].token_ids
    with pytest.raises(EngineError, match="prompt dict must be"):
        llm.generate({"text": "x"}, params)  # type: ignore[arg-type]


def test_get_tokenizer_is_the_model_tokenizer(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    (out,) = llm.generate(PROMPTS[2], SamplingParams(max_tokens=2), use_tqdm=False)
    assert tokenizer.encode(PROMPTS[2]) == out.prompt_token_ids


def test_use_tqdm_shows_progress_by_default(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    llm.generate(PROMPTS, SamplingParams(max_tokens=2))
    assert "4/4" in capsys.readouterr().err
    llm.generate(PROMPTS, SamplingParams(max_tokens=2), use_tqdm=False)
    assert "4/4" not in capsys.readouterr().err


def test_chat_takes_a_template_its_variables_and_the_generation_prompt_switch(llm: LLM) -> None:
    template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}{% if loud %}!{% endif %}"
    template += "{% if add_generation_prompt %}=>{% endif %}"
    chat = [{"role": "user", "content": "hi"}]
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(max_tokens=2)
    for kwargs, rendered in [
        ({"chat_template_kwargs": {"loud": True}}, "<hi>!=>"),
        ({"add_generation_prompt": False}, "<hi>"),
    ]:
        (out,) = llm.chat(chat, params, use_tqdm=False, chat_template=template, **kwargs)
        assert out.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)


def test_seeded_sampling_does_not_depend_on_the_batch(llm: LLM) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    alone = llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids
    in_batch = llm.generate(PROMPTS, params)[0].outputs[0].token_ids
    assert alone == in_batch
    other_seed = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=99)
    assert llm.generate(PROMPTS[0], other_seed)[0].outputs[0].token_ids != alone


def test_seeded_sampling_reproduces_across_engine_runs(llm: LLM, model_path: str) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=2)
    first = llm.generate(PROMPTS[1], params)[0]
    with LLM(model_path, kv_cache_memory=4 * 2**20, max_model_len=256) as other:
        again = other.generate(PROMPTS[1], params)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]


def test_n_samples_are_independent_and_greedy_samples_agree(llm: LLM) -> None:
    sampled = llm.generate(PROMPTS[2], SamplingParams(n=3, max_tokens=10, seed=3))[0]
    assert sorted(o.index for o in sampled.outputs) == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in sampled.outputs}) > 1
    greedy = SamplingParams(n=2, max_tokens=10, temperature=0.0, ignore_eos=True)
    a, b = llm.generate(PROMPTS[2], greedy)[0].outputs
    assert a.token_ids == b.token_ids and len(a.token_ids) == 10


def test_stop_string_cuts_the_text_where_it_starts(llm: LLM) -> None:
    base = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    full = llm.generate(PROMPTS[3], base)[0].outputs[0]
    stop = full.text[5:8]  # three characters from the middle, likely spanning tokens
    cut = full.text.index(stop)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    stopped = llm.generate(PROMPTS[3], params)[0].outputs[0]
    assert stopped.text == full.text[:cut]
    assert stopped.finish_reason == "stop"
    params.include_stop_str_in_output = True
    kept = llm.generate(PROMPTS[3], params)[0].outputs[0]
    assert kept.text == full.text[: cut + len(stop)]


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    base = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    full = llm.generate(PROMPTS[0], base)[0].outputs[0].token_ids
    stop_id = full[3]
    first = full.index(stop_id)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    params.stop_token_ids = [stop_id]
    out = llm.generate(PROMPTS[0], params)[0].outputs[0]
    assert out.token_ids == full[: first + 1] and out.finish_reason == "stop"
    params.min_tokens = 12  # the stop token may not end the output before 12 tokens
    assert len(llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids) == 12


def test_a_prompt_longer_than_max_model_len_is_refused_with_both_numbers(llm: LLM) -> None:
    too_long = list(range(5, 5 + 300))
    with pytest.raises(EngineError) as refused:
        llm.generate(too_long, SamplingParams(max_tokens=4))
    assert refused.value.status == 400
    assert "300" in refused.value.message and "256" in refused.value.message
    # The engine serves the next request normally.
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=3))[0].outputs[0].token_ids


async def test_streamed_deltas_add_up_and_abort_frees_every_block(model_path: str) -> None:
    settings = build_settings(
        **{"model.path": model_path, "cache.kv_cache_memory": 4 * 2**20, "model.max_model_len": 512}
    )
    with holding():
        async with AsyncLLM(settings) as engine:
            await _deltas_add_up_then_abort_frees_every_block(engine)


async def _deltas_add_up_then_abort_frees_every_block(engine: AsyncLLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    whole = await engine.complete(PROMPTS[0], params)
    text, tokens = "", []
    async for delta in engine.stream(PROMPTS[0], params):
        for part in delta.outputs:
            text += part.text
            tokens += part.token_ids
    assert (text, tokens) == (whole.outputs[0].text, whole.outputs[0].token_ids)

    # vLLM's generate: each output holds everything so far; the last one is finished.
    seen: list[RequestOutput] = [out async for out in engine.generate(PROMPTS[0], params)]
    lengths = [len(out.outputs[0].token_ids) for out in seen]
    assert lengths == sorted(lengths) and seen[-1].finished
    assert not any(out.finished for out in seen[:-1])
    assert seen[-1].outputs[0].token_ids == whole.outputs[0].token_ids
    assert seen[-1].outputs[0].text == whole.outputs[0].text

    # Held (tests/holds.py): still running after 8 s on any machine, when it is aborted.
    long_run = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    stream = engine.stream(held(list(range(5, 80))), long_run, request_id="to-abort")
    await stream.__anext__()  # generating now
    running = await _stats_when(engine, lambda s: s.num_requests == 1)
    assert running.kv_usage > 0.0
    assert await engine.abort("to-abort")
    await stream.aclose()
    stats = await _stats_when(engine, lambda s: s.num_requests == 0)
    assert stats.kv_usage == 0.0
    assert stats.num_free_blocks == stats.kv_cache_blocks


async def _stats_when(
    engine: AsyncLLM, condition: Callable[[EngineStats], bool], timeout: float = 10.0
) -> EngineStats:
    """The scheduler's first report meeting `condition` (reports lag a fraction of a second)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    stats = engine.stats()
    while loop.time() < deadline:
        stats = engine.stats()
        if condition(stats):
            return stats
        await asyncio.sleep(0.02)
    raise AssertionError(f"no scheduler report met the condition within {timeout}s: {stats}")


def test_prompt_logprobs_match_transformers_even_on_a_cached_prefix(
    llm: LLM, model_path: str
) -> None:
    from tests.hf_reference import hf_logits

    prompt = [3 + (7 * i) % 400 for i in range(45)]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3)
    first, again = llm.generate([prompt, prompt], params)  # the second may hit the prefix cache
    reference = torch.log_softmax(hf_logits(model_path, prompt), dim=-1)
    for output in (first, again):
        scores = output.prompt_logprobs
        assert scores is not None and len(scores) == len(prompt) and scores[0] is None
        for position, entry in enumerate(scores[1:], start=1):
            assert entry is not None and entry.token_id == prompt[position]
            expected = reference[position - 1]
            assert abs(entry.logprob - float(expected[prompt[position]])) < 1e-4
            assert [top.token_id for top in entry.top] == expected.topk(3).indices.tolist()
    plain = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert plain.prompt_logprobs is None


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_max_logprobs_bounds_logprobs_and_prompt_logprobs(llm: LLM, field: str) -> None:
    with pytest.raises(EngineError, match=rf"{field} is 6, more than this server allows \(5") as e:
        llm.generate(["x"], SamplingParams(max_tokens=1, **{field: 6}))
    assert e.value.status == 400 and e.value.param == field


def test_logit_bias_out_of_range_is_refused_as_over_http(llm: LLM) -> None:
    with pytest.raises(EngineError, match=r"logit_bias must be values in \[-100, 100\], got 150"):
        llm.generate(["x"], SamplingParams(max_tokens=1, logit_bias={7: 150.0}))


def test_prompt_logprobs_out_of_range_are_refused(llm: LLM) -> None:
    with pytest.raises(EngineError, match="prompt_logprobs must be an integer in") as error:
        llm.generate(["x"], SamplingParams(prompt_logprobs=21))
    assert error.value.status == 400 and error.value.param == "prompt_logprobs"
