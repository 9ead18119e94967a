"""ModelRunner's contract: logits only for sampled chunks in plan order, KV capacity from the
memory budget, and clear errors for malformed chunks."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import packed_weights
from engine.model.config import load_model_config
from engine.model.placement.capacity import kv_cache_blocks
from engine.model.placement.policy import ThreadPolicy, packed_weight_bytes
from engine.model.runner import ModelRunner
from engine.model.step_inputs import SeqChunk
from tests.checkpoints import tiny_checkpoint


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(str(tiny_checkpoint("qwen3")), kv_cache_memory=1 << 20, max_model_len=256)


def test_logits_only_for_sampled_chunks_in_plan_order(runner: ModelRunner) -> None:
    a, b, c = [7, 8, 9], [10, 11], [12, 13, 14, 15]
    together = runner.forward(
        [
            SeqChunk(1, a, 0, [0], True),
            SeqChunk(2, b, 0, [1], False),  # a prefill chunk that does not end its prompt
            SeqChunk(3, c, 0, [2], True),
        ]
    )
    assert together.shape == (2, runner.config.vocab_size) and together.dtype == torch.float32
    alone_a = runner.forward([SeqChunk(1, a, 0, [3], True)])
    alone_c = runner.forward([SeqChunk(3, c, 0, [4], True)])
    torch.testing.assert_close(together[0], alone_a[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(together[1], alone_c[0], atol=1e-5, rtol=1e-5)
    assert runner.forward([]).shape == (0, runner.config.vocab_size)
    assert runner.forward([SeqChunk(2, b, 0, [1], False)]).shape == (0, runner.config.vocab_size)


def test_kv_capacity_comes_from_the_memory_budget(runner: ModelRunner) -> None:
    config = runner.config
    # 2 layers x 16 tokens x (K + V) x 2 kv heads x 16 dims x 4 bytes = 8 KiB per block.
    assert kv_cache_blocks(config, 1 << 20, 16, torch.float32) == 128
    assert kv_cache_blocks(config, 1 << 20, 16, "bfloat16") == 256
    assert kv_cache_blocks(config, (1 << 13) - 1, 16, "float32") == 0
    assert runner.num_blocks == 128
    assert runner.config.max_model_len == 256
    with pytest.raises(ValueError, match="holds no block"):
        ModelRunner(str(tiny_checkpoint("qwen3")), kv_cache_memory=1000)


def test_default_capacity_is_a_fraction_of_available_memory() -> None:
    path = tiny_checkpoint("qwen3")
    small = ModelRunner(str(path), kv_cache_fraction=0.001)
    config = load_model_config(path)
    assert small.num_blocks >= 1
    # 0.1% of this machine's free memory: far more than a test asks for, far less than all of it.
    assert small.num_blocks * 8192 < 0.002 * _mem_total()
    assert config.num_layers == small.kv_cache.num_layers


def _mem_total() -> int:
    with open("/proc/meminfo") as meminfo:
        return int(meminfo.readline().split()[1]) * 1024


@pytest.mark.parametrize(
    ("chunk", "message"),
    [
        (SeqChunk(5, [], 0, [0], True), "sequence 5 has no tokens"),
        (SeqChunk(5, [1, 99999], 0, [0], True), "token id 99999 is out of range"),
        (SeqChunk(5, [-1], 0, [0], True), "token id -1 is out of range"),
        (SeqChunk(5, [1], -2, [0], True), "start_pos -2"),
        (SeqChunk(5, [1], 256, [0] * 17, True), "max_model_len is 256"),
        (SeqChunk(5, [1, 2, 3], 15, [0], True), "covers 16 tokens"),
        (SeqChunk(5, [1], 0, [128], True), "block id 128 is out of range"),
    ],
)
def test_malformed_chunks_are_rejected_with_the_reason(
    runner: ModelRunner, chunk: SeqChunk, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        runner.forward([chunk])


def test_bad_settings_are_rejected() -> None:
    path = str(tiny_checkpoint("qwen3"))
    with pytest.raises(ValueError, match="block_size must be a positive integer, got 0"):
        ModelRunner(path, block_size=0)
    with pytest.raises(ValueError, match=r"kv_cache_fraction must be in \(0, 1\], got 1.5"):
        ModelRunner(path, kv_cache_fraction=1.5)
    with pytest.raises(ValueError, match="unsupported device 'tpu'"):
        ModelRunner(path, device="tpu")


def test_a_step_of_long_decodes_runs_on_the_busy_threads(runner: ModelRunner) -> None:
    """ThreadPolicy counts the keys a step's attention reads, not only its tokens: a few decodes
    over a long context run on every core given to the rank."""
    before_policy, before_threads = runner.threads, torch.get_num_threads()
    runner.threads = ThreadPolicy(light=1, busy=2, busy_from_tokens=128, busy_from_keys=1000)
    table = list(range(14))  # 14 blocks of 16 slots: positions up to 223

    def decodes(count: int) -> list[SeqChunk]:
        return [SeqChunk(seq, [5], 200, table, True) for seq in range(count)]

    try:
        runner.forward(decodes(4))  # 4 x 201 keys
        assert torch.get_num_threads() == 1
        runner.forward(decodes(5))  # 5 x 201 keys
        assert torch.get_num_threads() == 2
    finally:
        runner.threads = before_policy
        torch.set_num_threads(before_threads)


def test_a_decoder_too_large_to_pack_keeps_its_weights_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past PACKED_DECODER_LIMIT the decoder's matmuls run on the checkpoint's weights: the
    runner prepares none of them, and the plan counts only the vocabulary projection's copy."""
    path = tiny_checkpoint("qwen3")
    config = load_model_config(str(path))
    head_bytes = config.vocab_size * config.hidden_size * 4
    packed = ModelRunner(str(path), kv_cache_memory=1 << 20, kernel_backend="cpu")
    assert packed_weight_bytes(config, "float32") > head_bytes
    monkeypatch.setattr(packed_weights, "PACKED_DECODER_LIMIT", 1024)
    assert packed_weight_bytes(config, "float32") == head_bytes
    plain = ModelRunner(str(path), kv_cache_memory=1 << 20, kernel_backend="cpu")
    for runner, prepared in ((packed, True), (plain, False)):
        attention = runner.model.layers[0].self_attn
        assert (attention.qkv_linear is not runner.backend.linear) == prepared
        assert (attention.o_proj.linear is not runner.backend.linear) == prepared
