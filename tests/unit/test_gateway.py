from __future__ import annotations

from engine.inflight.registry import Gateway
from engine.messages.failures import RequestFailed
from engine.messages.outputs import OutputBatch, SampleDeltaText, TextStarted
from engine.messages.params import SamplingParams
from engine.messages.requests import EngineRequest, GenerateRequest, PromptTokens
from engine.messages.scheduling import AbortRequests
from engine.request.outputs import EngineError, RequestOutput


def _delta(rid: str, epoch: int, index: int, tokens: list[int], text: str, finish=None):
    return SampleDeltaText(rid, epoch, index, tokens, text, None, finish)


def _drain(record) -> list[RequestOutput | EngineError]:
    items = []
    while not record.stream.empty():
        items.append(record.stream.get_nowait())
    return items


def test_a_request_gets_a_seed_even_without_one_so_resubmission_is_exact() -> None:
    gateway = Gateway()
    record, submission = gateway.register(
        EngineRequest(params=SamplingParams(temperature=1.0), prompt="hi")
    )
    assert submission.seed == record.seed
    assert submission.epoch == 0 and submission.resume is None


def test_outputs_of_a_stale_epoch_are_dropped_and_resume_carries_what_was_delivered() -> None:
    gateway = Gateway()
    record, _ = gateway.register(
        EngineRequest(params=SamplingParams(n=2, max_tokens=8), prompt="hi", request_id="r")
    )
    gateway.learn_prompt(PromptTokens("r", 0, [1, 2, 3]))
    gateway.deliver(
        OutputBatch([], [_delta("r", 0, 0, [7], "a"), _delta("r", 0, 1, [8], "b", "stop")], [])
    )
    [resubmission] = gateway.resubmit_all()
    assert resubmission.epoch == 1
    assert resubmission.request.prompt_token_ids == [1, 2, 3]
    # Sample 1 finished: only sample 0 is resumed, from exactly what its client has.
    assert [(r.index, r.delivered_token_ids) for r in resubmission.resume] == [(0, [7])]
    # A late output of epoch 0 must not reach the client a second time.
    gateway.deliver(OutputBatch([], [_delta("r", 0, 0, [9], "c")], []))
    gateway.deliver(OutputBatch([], [_delta("r", 1, 0, [9], "c", "length")], []))
    outputs = _drain(record)
    tokens = [o.token_ids for out in outputs for o in out.outputs if o.index == 0]
    assert tokens == [[7], [9]]
    assert outputs[-1].finished and "r" not in gateway


def test_a_late_delta_of_the_old_epoch_does_not_take_the_new_epochs_with_it() -> None:
    gateway = Gateway()
    record, _ = gateway.register(
        EngineRequest(params=SamplingParams(max_tokens=3), prompt="hi", request_id="r")
    )
    gateway.learn_prompt(PromptTokens("r", 0, [1, 2]))
    gateway.deliver(OutputBatch([], [_delta("r", 0, 0, [7], "a")], []))
    [resubmission] = gateway.resubmit_all()
    assert resubmission.epoch == 1 and resubmission.resume[0].delivered_token_ids == [7]
    batch = [_delta("r", 0, 0, [8], "b"), _delta("r", 1, 0, [9], "c")]  # one detokenizer batch
    gateway.deliver(OutputBatch([], batch, []))
    gateway.deliver(OutputBatch([], [_delta("r", 1, 0, [5], "d", "length")], []))
    tokens = [o.token_ids for out in _drain(record) for o in out.outputs]
    assert tokens == [[7], [9], [5]]


def test_deltas_of_one_sample_that_arrive_together_make_one_output() -> None:
    """A reader takes outputs[i] as sample i's news: two steps' deltas read in one batch must
    not come as two outputs of the same sample (the second was missed by such a reader)."""
    gateway = Gateway()
    record, _ = gateway.register(
        EngineRequest(params=SamplingParams(n=2, max_tokens=8), prompt="hi", request_id="r")
    )
    gateway.learn_prompt(PromptTokens("r", 0, [1, 2, 3]))
    batch = [_delta("r", 0, 0, [7], "a"), _delta("r", 0, 1, [5], "x"), _delta("r", 0, 0, [8], "b")]
    gateway.deliver(OutputBatch([], batch, []))
    [out] = _drain(record)
    joined = [(o.index, o.token_ids, o.text) for o in out.outputs]
    assert joined == [(0, [7, 8], "ab"), (1, [5], "x")]


def test_a_failure_reaches_the_stream_as_an_error_and_forgets_the_request() -> None:
    gateway = Gateway()
    record, _ = gateway.register(
        EngineRequest(params=SamplingParams(), prompt="x", request_id="bad")
    )
    failure = RequestFailed(
        request_id="bad", epoch=0, status=400, message="too long", actor="tokenizer", param="prompt"
    )
    gateway.deliver(OutputBatch([], [], [failure]))
    [error] = _drain(record)
    assert isinstance(error, EngineError) and error.status == 400 and error.param == "prompt"
    assert len(gateway) == 0


def test_abort_finishes_the_stream_and_returns_the_abort_to_send() -> None:
    gateway = Gateway()
    record, _ = gateway.register(
        EngineRequest(params=SamplingParams(n=2), prompt="x", request_id="a")
    )
    abort = gateway.abort("a")
    assert abort is not None and abort.request_ids == ["a"]
    [final] = _drain(record)
    assert final.finished and {o.finish_reason for o in final.outputs} == {"abort"}
    assert gateway.abort("a") is None


def test_a_stream_left_full_and_unread_past_the_timeout_is_aborted() -> None:
    # Timeout 0: the output that fills the buffer already finds it stalled.
    gateway = Gateway(stream_buffer=2, stalled_stream_timeout=0.0)
    params = SamplingParams(max_tokens=100)
    record, _ = gateway.register(
        EngineRequest(params=params, prompt_token_ids=[1], request_id="slow")
    )
    reader_keeps_up, _ = gateway.register(
        EngineRequest(params=params, prompt_token_ids=[1], request_id="ok")
    )
    for step in range(3):
        gateway.deliver(
            OutputBatch(
                [], [_delta("slow", 0, 0, [step], "t"), _delta("ok", 0, 0, [step], "t")], []
            )
        )
        _drain(reader_keeps_up)
    assert "slow" not in gateway and "ok" in gateway
    assert gateway.take_submissions() == [AbortRequests(["slow"])]
    outputs = _drain(record)
    assert [t for out in outputs for o in out.outputs for t in o.token_ids] == [0, 1]
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"


def test_unseeded_requests_draw_their_seeds_from_the_engine_seed() -> None:
    def seeds(gateway: Gateway) -> list[int]:
        return [
            gateway.register(EngineRequest(params=SamplingParams(), prompt="x"))[0].seed
            for _ in range(3)
        ]

    first, again, other = seeds(Gateway(seed=0)), seeds(Gateway(seed=0)), seeds(Gateway(seed=1))
    assert first == again and len(set(first)) == 3  # reproducible, yet distinct per request
    assert first != other
    assert (
        Gateway(seed=0).register(EngineRequest(params=SamplingParams(seed=7), prompt="x"))[0].seed
        == 7
    )


def test_outputs_that_come_before_the_ids_of_their_text_prompt_wait_for_them() -> None:
    """The ids come from the tokenizer on a ring of their own: a request's outputs, even its
    finish, may be read first. Its client gets them with the ids, never without."""
    gateway = Gateway()
    record, _ = gateway.register(
        EngineRequest(params=SamplingParams(max_tokens=2), prompt="hi", request_id="r")
    )
    gateway.deliver(OutputBatch([TextStarted("r", 0)], [_delta("r", 0, 0, [7], "a")], []))
    gateway.deliver(OutputBatch([], [_delta("r", 0, 0, [8], "b", "length")], []))
    assert _drain(record) == [] and "r" in gateway
    gateway.learn_prompt(PromptTokens("r", 1, [9, 9]))  # of an epoch it is not in: dropped
    assert _drain(record) == []
    gateway.learn_prompt(PromptTokens("r", 0, [4, 5, 6]))
    [out] = _drain(record)
    assert out.finished and out.prompt_token_ids == [4, 5, 6]
    assert [(o.token_ids, o.text) for o in out.outputs] == [([7, 8], "ab")]
    assert "r" not in gateway


def test_a_restarted_tokenizer_costs_the_requests_whose_ids_the_gateway_lacks() -> None:
    """Past the tokenizer (acknowledged) but without the ids of its text: resubmitted as text,
    under a new epoch whose outputs alone count; with its ids, a request runs on untouched."""
    gateway = Gateway()
    tokenized, _ = gateway.register(
        EngineRequest(params=SamplingParams(), prompt="a", request_id="known")
    )
    lacking, _ = gateway.register(
        EngineRequest(params=SamplingParams(), prompt="b", request_id="lacking")
    )
    gateway.register(
        EngineRequest(params=SamplingParams(), prompt_token_ids=[3], request_id="waiting")
    )
    gateway.deliver(OutputBatch([TextStarted("known", 0), TextStarted("lacking", 0)], [], []))
    gateway.learn_prompt(PromptTokens("known", 0, [1]))
    gateway.deliver(OutputBatch([], [_delta("lacking", 0, 0, [7], "x")], []))  # kept back
    lost = gateway.lost_with_tokenizer()
    assert lost == {"lacking", "waiting"}
    again = {s.request_id: s for s in gateway.resubmit_all(lost) if isinstance(s, GenerateRequest)}
    assert (
        again["lacking"].request.prompt == "b" and again["lacking"].request.prompt_token_ids is None
    )
    # What was kept back never reached the client: the sample starts again from nothing.
    assert [(r.index, r.delivered_token_ids) for r in again["lacking"].resume] == [(0, [])]
    assert tokenized.epoch == 0 and lacking.epoch == 1
    gateway.learn_prompt(PromptTokens("lacking", 0, [2]))  # the old epoch's, late: dropped
    assert lacking.prompt_token_ids is None
    gateway.learn_prompt(PromptTokens("lacking", 1, [2]))
    assert _drain(lacking) == []  # the old epoch's early output went with it
    assert lacking.prompt_token_ids == [2]
