"""Speculative decoding's draft model, on worker rank 0: proposals for the target to verify.

The draft is a second ModelRunner with a KV cache of its own, as many blocks as the target's
and of the same size, so the scheduler's block tables serve both (as vLLM v1 shares them). The
draft sees every token of a sequence, prompt included, but only when the sequence drafts: a
decode chunk that the scheduler asks to draft for (`PlannedChunk.num_draft`, blocks reserved)
first runs through the draft together with every token the draft has not seen yet (the prompt
at the first draft, the tokens of the steps it paused, an accepted last proposal), then gets its
tokens, drawn one position at a time, batched over the sequences: the first from the logits of
that pass, each next one from a one-token pass of the previous draft token. A step in which no
sequence drafts never runs the draft.

A greedy request's draft token is the draft's argmax. A sampled request's is drawn from q, the
draft's distribution under the request's temperature, min_p, top_k and top_p, with the noise the
target's own draw uses at that position (engine/model/sampling/randomness.py): where the two models
agree, the draft token is the token the target will draw. The target keeps a proposal only where
it equals its own draw (engine/model/speculation/verify.py), so the output is the non-speculative
output token for token, and a resumed stream continues as the undisturbed one would. With
`rejection_sampling` (vLLM's rule, opted into) q goes with the proposals to the rejection
sampler instead.

A sequence re-announced (after preemption or a restart) may have new blocks: the draft then
runs it from its first token again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import msgspec
import torch

from engine.model.config import load_model_config
from engine.model.loading.loader import resolve_dtype
from engine.model.placement.capacity import kv_block_bytes
from engine.model.runner import ModelRunner
from engine.model.sampling.randomness import gumbel_argmax
from engine.model.sampling.sampler import Sampler, final_logits, is_greedy
from engine.model.step_inputs import SeqChunk


class Drafter:
    def __init__(
        self,
        model_path: str,
        target: ModelRunner,
        *,
        dtype: str = "auto",
        kernel_backend: str = "auto",
        num_threads: int | None = None,
        busy_threads: int | None = None,
        rejection_sampling: bool = False,
        weights_of_run: str | None = None,
    ) -> None:
        """`rejection_sampling`: sampled proposals verified by vLLM's rule against q (`probs`),
        not against the target's own draws. `weights_of_run`: as the target's (ModelRunner),
        the draft's weights kept for a restarted worker in a segment of their own."""
        config = load_model_config(model_path, target.config.max_model_len)
        vocab = target.config.vocab_size
        if config.vocab_size != vocab:
            raise ValueError(
                f"speculative_config model {model_path} has a vocabulary of "
                f"{config.vocab_size} tokens, the target's has {vocab}: a draft model must "
                "share the target's tokenizer"
            )
        block_bytes = kv_block_bytes(
            config, target.block_size, resolve_dtype(dtype, config, target.device)
        )
        self.runner = ModelRunner(
            model_path,
            dtype=dtype,
            device=str(target.device),
            block_size=target.block_size,
            kv_cache_memory=target.num_blocks * block_bytes,
            max_model_len=target.config.max_model_len,
            num_threads=num_threads,
            busy_threads=busy_threads,
            kernel_backend=kernel_backend,
            weights_of_run=weights_of_run,
        )
        if self.runner.num_blocks != target.num_blocks:
            raise RuntimeError(
                f"the draft's KV cache has {self.runner.num_blocks} blocks, the target's "
                f"{target.num_blocks}: they share block tables"
            )
        self.vocab_size = vocab
        self.rejection_sampling = rejection_sampling
        self.probs: dict[int, torch.Tensor] = {}  # this step's q rows by sequence id
        self._seen: dict[int, int] = {}  # seq id -> positions before it are in the draft's KV

    def forget(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._seen.pop(seq_id, None)

    def reset(self) -> None:
        self._seen.clear()
        self.probs = {}

    @torch.inference_mode()
    def propose(
        self, chunks: Sequence[SeqChunk], num_draft: Mapping[int, int], sampler: Sampler
    ) -> list[SeqChunk]:
        """`chunks` with their drafts (`num_draft` by sequence id) appended as proposals
        (num_proposed). With rejection sampling `probs` then holds the q rows of sampled
        requests' proposals."""
        self.probs = {}
        wanted = {chunk.seq_id: num_draft.get(chunk.seq_id, 0) for chunk in chunks if chunk.sample}
        drafting = [chunk for chunk in chunks if wanted.get(chunk.seq_id, 0) > 0]
        if not drafting:
            return list(chunks)
        logits = self.runner.forward([self._catch_up(chunk, sampler) for chunk in drafting])
        drafts: dict[int, list[int]] = {chunk.seq_id: [] for chunk in drafting}
        q_rows: dict[int, list[torch.Tensor]] = {}
        depth = 0
        live = drafting
        while live:
            tokens = self._draw(live, logits, depth, sampler, q_rows)
            for chunk, token in zip(live, tokens, strict=True):
                drafts[chunk.seq_id].append(token)
            depth += 1
            live = [chunk for chunk in live if wanted[chunk.seq_id] > depth]
            if live:
                logits = self.runner.forward(
                    [
                        SeqChunk(
                            chunk.seq_id,
                            [drafts[chunk.seq_id][-1]],
                            _last_position(chunk) + depth,
                            chunk.block_table,
                            True,
                        )
                        for chunk in live
                    ]
                )
        if self.rejection_sampling:
            self.probs = {seq_id: torch.stack(rows) for seq_id, rows in q_rows.items()}
        return [_with_proposals(chunk, drafts.get(chunk.seq_id, [])) for chunk in chunks]

    def settle(self, chunks: Sequence[SeqChunk], seq_ids: Sequence[int]) -> None:
        """After the target's verification (`seq_ids`: one per emitted token): the draft's KV
        holds the drafting sequences' tokens up to their accepted proposals, except a last
        proposal, which the draft drew but never ran."""
        emitted: dict[int, int] = {}
        for seq_id in seq_ids:
            emitted[seq_id] = emitted.get(seq_id, 0) + 1
        for chunk in chunks:
            if chunk.num_proposed and chunk.seq_id in emitted:
                accepted = emitted[chunk.seq_id] - 1
                first_proposal = chunk.start_pos + len(chunk.token_ids) - chunk.num_proposed
                self._seen[chunk.seq_id] = first_proposal + min(accepted, chunk.num_proposed - 1)

    def _catch_up(self, chunk: SeqChunk, sampler: Sampler) -> SeqChunk:
        """The decode chunk as the draft runs it: with the tokens before it that the draft has
        not seen (the sampler holds the sequence's history), logits for its last."""
        end = chunk.start_pos + len(chunk.token_ids)
        start = min(self._seen.get(chunk.seq_id, 0), chunk.start_pos)
        tokens = sampler.history(chunk.seq_id, start)
        if len(tokens) != end - start:  # not the end of its history: the chunk alone
            tokens, start = chunk.token_ids, chunk.start_pos
        return SeqChunk(chunk.seq_id, tokens, start, chunk.block_table, True)

    def _draw(
        self,
        live: list[SeqChunk],
        logits: torch.Tensor,
        depth: int,
        sampler: Sampler,
        q_rows: dict[int, list[torch.Tensor]],
    ) -> list[int]:
        """The draft's token at `depth` for each of `live` (logits rows in their order)."""
        logits = logits[:, : self.vocab_size].float()
        tokens = logits.argmax(dim=-1)
        settings = [sampler.params_and_seed(chunk.seq_id) for chunk in live]
        rows = [row for row, (params, _) in enumerate(settings) if not is_greedy(params)]
        if rows:
            index = torch.tensor(rows, device=logits.device)
            final = final_logits(logits[index], [settings[row][0] for row in rows])
            seeds = [settings[row][1] for row in rows]
            # The position the drawn token takes: the target's draw there uses this noise.
            positions = [_last_position(live[row]) + 1 + depth for row in rows]
            tokens[index] = gumbel_argmax(final, seeds, positions).to(tokens.dtype)
            if self.rejection_sampling:
                probs = torch.softmax(final, dim=-1)
                for offset, row in enumerate(rows):
                    q_rows.setdefault(live[row].seq_id, []).append(probs[offset])
        return [int(token) for token in tokens.tolist()]


def _last_position(chunk: SeqChunk) -> int:
    return chunk.start_pos + len(chunk.token_ids) - 1


def _with_proposals(chunk: SeqChunk, drafts: list[int]) -> SeqChunk:
    if not drafts:
        return chunk
    return msgspec.structs.replace(
        chunk, token_ids=chunk.token_ids + drafts, num_proposed=len(drafts)
    )
