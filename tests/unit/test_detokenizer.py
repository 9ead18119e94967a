"""Incremental detokenization and stop strings, with a real byte-level BPE tokenizer."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.messages.failures import RequestFailed
from engine.messages.outputs import TextStarted
from engine.messages.params import SamplingParams
from engine.messages.ring_catalogue import TOKENS_RING
from engine.messages.scheduling import (
    AbortRequests,
    SampleDelta,
    SampleResume,
    SubmitRequest,
    TextStart,
    TokenBatch,
)
from engine.messages.steps import SampledLogprobs
from engine.text import Detokenizer, IncrementalDetokenizer, SampleTextStream, StopStrings
from engine.text.detokenizer import text_start
from engine.text.incremental import PROMPT_CONTEXT_TOKENS
from tests.fresh_process import imported_after

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "stop here please, and then go on with the story of the fox",
    "héllo wörld, ça va? naïve café crème brûlée",
    "日本語のテキストも少し 混ぜておく 🙂 👍🏽 emoji too",
] * 20


@pytest.fixture(scope="module")
def raw_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<eos>", "<sep>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer(raw_tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=raw_tokenizer, eos_token="<eos>")


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream_all(
    stream: SampleTextStream, ids: list[int], finish: str | None = "length"
) -> list[str]:
    """Push tokens one at a time, the last one with `finish`; the deltas sent."""
    deltas = [stream.push([token]) for token in ids[:-1]]
    deltas.append(stream.push(ids[-1:], finish))
    return deltas


# ---- incremental decoding ------------------------------------------------------------------------


def test_the_fixture_splits_characters_across_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = encode(tokenizer, "日本語 🙂 👍🏽")
    alone = [tokenizer.decode([token]) for token in ids]
    assert any("\ufffd" in text for text in alone), "no multi-byte character was split"


@pytest.mark.parametrize("text", [CORPUS[0], CORPUS[2], CORPUS[3], "🙂🙂👍🏽 ok 語語"])
def test_incremental_text_equals_the_full_decode_and_never_ends_mid_character(
    tokenizer: PreTrainedTokenizerFast, text: str
) -> None:
    prompt = encode(tokenizer, "the fox said: ")
    ids = encode(tokenizer, text)
    stream = SampleTextStream(tokenizer, prompt, SamplingParams())
    deltas = stream_all(stream, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in delta for delta in deltas)
    assert stream.finish_reason == "length"


def test_a_plain_tokenizers_tokenizer_works_too(raw_tokenizer: Tokenizer) -> None:
    ids = raw_tokenizer.encode(CORPUS[3]).ids
    detokenizer = IncrementalDetokenizer(raw_tokenizer, [])
    assert "".join(detokenizer.step(token) for token in ids) == CORPUS[3]


def test_special_tokens_are_skipped_or_kept_as_asked(tokenizer: PreTrainedTokenizerFast) -> None:
    eos = tokenizer.eos_token_id
    ids = [*encode(tokenizer, "hello"), eos, *encode(tokenizer, " world")]
    skipped = SampleTextStream(tokenizer, [], SamplingParams())
    kept = SampleTextStream(tokenizer, [], SamplingParams(skip_special_tokens=False))
    assert "".join(stream_all(skipped, ids)) == "hello world"
    assert "".join(stream_all(kept, ids)) == "hello<eos> world"


def test_a_stop_token_adds_no_text_unless_asked(tokenizer: PreTrainedTokenizerFast) -> None:
    sep = tokenizer.convert_tokens_to_ids("<sep>")
    ids = [*encode(tokenizer, "fox"), sep]
    params = SamplingParams(skip_special_tokens=False)
    plain = SampleTextStream(tokenizer, [], params)
    assert "".join(stream_all(plain, ids, "stop")) == "fox"
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)
    included = SampleTextStream(tokenizer, [], params)
    assert "".join(stream_all(included, ids, "stop")) == "fox<sep>"


# ---- stop strings --------------------------------------------------------------------------------


def test_earliest_ending_stop_string_wins() -> None:
    stops = StopStrings(["abcd", "bc"], include_in_output=False)
    assert stops.hold_back == 3
    assert stops.find_cut("xxabcd", 2) == 3
    assert StopStrings(["abcd", "bc"], include_in_output=True).find_cut("xxabcd", 2) == 5
    assert stops.find_cut("xxabc", 5) is None  # nothing new can complete a match
    assert StopStrings([""], include_in_output=False).find_cut("abc", 0) is None


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_split_across_tokens_ends_the_text_there(
    tokenizer: PreTrainedTokenizerFast, include: bool
) -> None:
    text = CORPUS[1]
    ids = encode(tokenizer, text)
    params = SamplingParams(stop=["here please"], include_stop_str_in_output=include)
    stream = SampleTextStream(tokenizer, [], params)
    deltas = [stream.push([token]) for token in ids]
    cut = text.index("here please") + (len("here please") if include else 0)
    assert "".join(deltas) == text[:cut]
    assert stream.finish_reason == "stop"
    assert stream.push(ids[:2]) == ""  # late tokens add nothing


@pytest.mark.parametrize("stop", ["語の", "🙂", "ö", "本語のテ"])
def test_a_stop_string_inside_multibyte_characters_is_found(
    tokenizer: PreTrainedTokenizerFast, stop: str
) -> None:
    text = CORPUS[2] + " " + CORPUS[3]
    ids = encode(tokenizer, text)
    stream = SampleTextStream(tokenizer, [], SamplingParams(stop=[stop]))
    sent = "".join(stream_all(stream, ids))
    assert sent == text[: text.index(stop)]
    assert stream.finish_reason == "stop"


def test_text_that_may_start_a_stop_string_is_held_back_until_decided(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    stream = SampleTextStream(tokenizer, [], SamplingParams(stop=["fox jumps"]))
    sent = ""
    for token in encode(tokenizer, "the quick brown fox runs"):
        sent += stream.push([token])
        assert len(sent) <= len(stream.text) - min(len(stream.text), 8) or stream.finished
    sent += stream.push([], "length")
    assert sent == "the quick brown fox runs"


# ---- re-priming ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stops", [[], ["zzz"], ["fox jumps"]])
def test_a_reprimed_stream_continues_exactly_where_the_client_left_off(
    tokenizer: PreTrainedTokenizerFast, stops: list[str]
) -> None:
    prompt = encode(tokenizer, "once: ")
    ids = encode(tokenizer, CORPUS[0] + " " + CORPUS[3])
    params = SamplingParams(stop=stops)
    original = SampleTextStream(tokenizer, prompt, params)
    sent_after = [""]
    for token in ids:
        sent_after.append(sent_after[-1] + original.push([token]))
    for delivered in random.Random(0).sample(range(1, len(ids)), 10):
        resumed = SampleTextStream(tokenizer, prompt, params, ids[:delivered])
        assert resumed.sent == len(sent_after[delivered])
        rest = "".join(resumed.push([token]) for token in ids[delivered:])
        assert sent_after[delivered] + rest == sent_after[-1]


def test_tokens_batched_differently_give_the_same_text(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = encode(tokenizer, CORPUS[3] + CORPUS[2])
    params = SamplingParams(stop=["naïve"])
    one_by_one = SampleTextStream(tokenizer, [], params)
    in_groups = SampleTextStream(tokenizer, [], params)
    expected = "".join(one_by_one.push([token]) for token in ids)
    rng = random.Random(1)
    got, start = "", 0
    while start < len(ids):
        size = rng.randint(1, 4)
        got += in_groups.push(ids[start : start + size])
        start += size
    assert got == expected


# ---- the request-level detokenizer ---------------------------------------------------------------


def _submit(tokenizer: PreTrainedTokenizerFast, epoch: int = 0, **params: object) -> TextStart:
    prompt = encode(tokenizer, "tell me: ")
    submit = SubmitRequest("r", epoch, prompt, SamplingParams(**params), seed=1)  # type: ignore[arg-type]
    return text_start(submit)


def test_the_detokenizer_streams_samples_and_reports_stop_string_stops(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    detokenizer = Detokenizer(tokenizer)
    out = detokenizer.handle([_submit(tokenizer, n=2, stop=["lazy"])])
    assert out.batch is not None
    assert [p.request_id for p in out.batch.started] == ["r"]
    ids = encode(tokenizer, "over the lazy dog")
    texts = {0: "", 1: ""}
    stops = []
    for token in ids:
        batch = TokenBatch([SampleDelta("r", 0, 0, [token]), SampleDelta("r", 0, 1, [token])])
        out = detokenizer.handle([batch, TokenBatch([SampleDelta("r", 9, 0, [token])])])
        stops += out.stops
        for sample in out.batch.samples if out.batch else []:
            assert sample.epoch == 0  # the other epoch's tokens were dropped
            texts[sample.index] += sample.text
    assert texts == {0: "over the ", 1: "over the "}
    assert {(s.request_id, s.epoch, tuple(s.indices)) for s in stops} == {
        ("r", 0, (0,)),
        ("r", 0, (1,)),
    }
    assert len(detokenizer) == 0  # both samples finished: nothing kept


def test_the_detokenizer_resumes_a_newer_epoch_from_the_delivered_tokens(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    ids = encode(tokenizer, CORPUS[3])
    detokenizer = Detokenizer(tokenizer)
    detokenizer.handle([_submit(tokenizer)])
    first = detokenizer.handle([TokenBatch([SampleDelta("r", 0, 0, ids[:7])])])
    assert first.batch is not None
    resubmit = _submit(tokenizer, epoch=1)
    resubmit.resume = [SampleResume(0, ids[:7])]
    rest = detokenizer.handle(
        [resubmit, TokenBatch([SampleDelta("r", 1, 0, ids[7:], None, "length")])]
    )
    assert rest.batch is not None
    [sample] = rest.batch.samples
    assert first.batch.samples[0].text + sample.text == CORPUS[3]
    assert sample.finish_reason == "length"


def test_aborts_rejections_and_logprobs(tokenizer: PreTrainedTokenizerFast) -> None:
    detokenizer = Detokenizer(tokenizer)
    detokenizer.handle([_submit(tokenizer, logprobs=1)])
    [token] = encode(tokenizer, "fox")[:1]
    entry = SampledLogprobs(-0.5, [token], [-0.5])
    out = detokenizer.handle([TokenBatch([SampleDelta("r", 0, 0, [token], [entry])])])
    assert out.batch is not None
    [logprobs] = out.batch.samples[0].logprobs or []
    assert (logprobs.token_id, logprobs.logprob) == (token, -0.5)
    assert logprobs.token == tokenizer.decode([token])
    assert [(t.token_id, t.token) for t in logprobs.top] == [(token, logprobs.token)]
    detokenizer.handle([AbortRequests(["r"])])
    assert len(detokenizer) == 0
    assert detokenizer.handle([TokenBatch([SampleDelta("r", 0, 0, [token])])]).batch is None
    refused = RequestFailed(
        request_id="q", epoch=2, status=400, message="prompt too long", actor="scheduler"
    )
    out = detokenizer.handle([refused])
    assert out.batch is not None
    [failure] = out.batch.failures
    assert (failure.request_id, failure.epoch, failure.status) == ("q", 2, 400)
    # A failed resubmission ends the request: the streams of its older epoch go too.
    detokenizer.handle([text_start(SubmitRequest("old", 0, [token], SamplingParams(), 1))])
    assert len(detokenizer) == 1
    resubmission_failed = RequestFailed(
        request_id="old", epoch=1, status=400, message="too big", actor="tokenizer"
    )
    detokenizer.handle([resubmission_failed])
    assert len(detokenizer) == 0


def test_the_start_message_carries_the_prompt_only_where_it_is_needed(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    prompt = [random.Random(7).randrange(10, 200) for _ in range(1000)]
    plain = SubmitRequest("r", 0, prompt, SamplingParams(), seed=1)
    start = text_start(plain)
    assert start.prompt_token_ids is None
    assert start.context_token_ids == prompt[-PROMPT_CONTEXT_TOKENS:]
    assert len(TOKENS_RING.encode(start)) < 100  # the whole prompt alone takes ~2 KB
    detokenizer = Detokenizer(tokenizer)
    out = detokenizer.handle([start])
    assert out.batch is not None
    assert out.batch.started == [TextStarted("r", 0)]  # the gateway's acknowledgement
    # Prompt logprobs are named by the prompt's tokens: then it comes along.
    asked = SubmitRequest("p", 0, prompt[:3], SamplingParams(prompt_logprobs=0), seed=1)
    start = text_start(asked)
    assert start.prompt_token_ids == prompt[:3]
    detokenizer.handle([start])
    entries = [SampledLogprobs(-1.0, [], []), SampledLogprobs(-2.0, [], [])]
    delta = SampleDelta("p", 0, 0, [prompt[0]], prompt_logprobs=entries)
    out = detokenizer.handle([TokenBatch([delta])])
    assert out.batch is not None
    named = out.batch.samples[0].prompt_logprobs or []
    assert [(e.token_id, e.logprob) for e in named] == [(prompt[1], -1.0), (prompt[2], -2.0)]


def test_engine_text_does_not_import_torch() -> None:
    assert imported_after("import engine.text", ("torch",)) == []


def test_stop_reason_names_the_stop_string_or_stop_token_and_is_none_otherwise(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    ids = encode(tokenizer, "the quick brown fox jumps over the lazy dog")
    by_string = SampleTextStream(tokenizer, [], SamplingParams(stop=["lazy", "fox"]))
    by_string.push(ids)
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", "fox")
    by_token = SampleTextStream(tokenizer, [], SamplingParams(stop_token_ids=[ids[3]]))
    by_token.push(ids[:4], "stop")
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", ids[3])
    for reason in ("stop", "length"):  # EOS (a "stop" by no stop token of the request), length
        plain = SampleTextStream(tokenizer, [], SamplingParams(stop_token_ids=[ids[0]]))
        plain.push(ids[1:4], reason)
        assert (plain.finish_reason, plain.stop_reason) == (reason, None)
