"""A model whose every layer has a sliding window (Mistral v0.1, Phi-3-mini) gives each
sequence's blocks before its window back to the pool as it runs: a long stream holds about
window / block_size blocks, not its length's, and streams several times longer than the cache
run to the end with the tokens they would have had. The reference worker checks that every key
a token may see (its window) is read back as written."""

from __future__ import annotations

from engine.messages.steps import StepPlan, StepResult
from tests.unit.test_scheduler import (
    Outputs,
    ReferenceWorker,
    assert_no_state_left,
    expected,
    make,
    step,
    submit,
)

WINDOW = 10


class WindowedWorker(ReferenceWorker):
    """Writes every token's KV; reads back only the keys of the sampling token's window."""

    def run(self, plan: StepPlan) -> StepResult:
        starts, chunks = self.known.apply(plan)
        for seq_id in plan.finished_seq_ids:
            self.history.pop(seq_id)
        for new in starts:
            self.history[new.seq_id] = [*new.prompt_token_ids, *new.output_token_ids]
            self.seeds[new.seq_id] = new.seed
        seq_ids, token_ids = [], []
        for chunk in chunks:
            history = self.history[chunk.seq_id]
            end = chunk.start_pos + len(chunk.token_ids)
            for offset, token in enumerate(chunk.token_ids):
                position = chunk.start_pos + offset
                self.cache[chunk.block_table[position // self.block_size]][
                    position % self.block_size
                ] = token
            if chunk.sample:
                window = range(max(0, end - WINDOW), end)
                seen = [self.cache[chunk.block_table[p // 4]][p % 4] for p in window]
                assert seen == history[window.start :], f"seq {chunk.seq_id} read wrong KV"
                token = self.next_token(self.seeds[chunk.seq_id], history)
                history.append(token)
                seq_ids.append(chunk.seq_id)
                token_ids.append(token)
        return StepResult(plan.step_id, seq_ids, token_ids, None)


def test_long_streams_hold_their_window_not_their_length() -> None:
    # 24 blocks of 4 tokens: 96 slots for three streams of 150 tokens each.
    scheduler, _ = make(
        num_blocks=24, max_model_len=160, max_num_batched_tokens=8, sliding_window=WINDOW
    )
    worker = WindowedWorker(4)
    prompts = {f"r{i}": [3 + i, 7, 11, 13 + i] for i in range(3)}
    for request_id, prompt in prompts.items():
        assert scheduler.add(submit(request_id, prompt, max_tokens=146, ignore_eos=True)) is None
    outputs, most_used = Outputs(), 0
    for _ in range(2000):
        if step(scheduler, worker, outputs) is None and not scheduler.has_unfinished_requests:
            break
        most_used = max(most_used, 24 - scheduler.kv.num_free_blocks)
    for request_id, prompt in prompts.items():
        assert outputs.tokens[(request_id, 0)] == expected(prompt, 1, 146, max_model_len=160)
    # Each stream: its window (10 keys: up to 4 blocks), its step's chunk and the next block.
    assert most_used <= 3 * (WINDOW // 4 + 3)
    worker.history.clear()
    assert_no_state_left(scheduler, worker)
