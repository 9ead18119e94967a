"""One step on a worker rank: take in the plan, run the model, sample; a failing sequence fails
alone.

A step that raises is run again one sequence at a time: the sequences that fail alone are
reported in a WorkerFailed (their requests fail with status 500) and the StepResult carries the
others. Rerunning is safe: a chunk writes the same KV slots with the same values again, and
sampling is a function of (seed, position), so a sequence gets the token it would have. When
every sequence fails alone too, or steps keep failing with nothing succeeding in between, the
fault is the worker's, not the requests': `run` raises, the worker crashes, and the supervisor
restarts it (the gateway quarantines a request that keeps crashing it). So does a failed
collective (a rank of the group is gone): that is never a request's fault.

Under tensor parallelism the ranks must take the same path, or one issues collectives the others
never join. So a step has three parts: what each rank does alone before the model (preparing
inputs), the model (collectives), and what follows (rank 0 samples). After the first and the
last part every rank says whether its part failed (`failed_ranks`, one small all-reduce), and all
of them fail the step, and isolate its sequences, together. A rank that fails inside the model
cannot know where its peers wait: it fails the group (CollectiveError), which restarts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from engine.messages.steps import SampledLogprobs, StepPlan, StepResult, WorkerFailed
from engine.model.parallel.group import CollectiveError
from engine.model.pooling import Pooling, PoolingStep
from engine.model.runner import ModelRunner
from engine.model.sampling.prompt_scoring import PromptScoring
from engine.model.sampling.sampler import Sampler
from engine.model.speculation.drafter import Drafter
from engine.model.speculation.verify import verify_proposals
from engine.model.step_inputs import KnownSequences, SeqChunk, SequenceStart
from engine.structured.grammars import GrammarsBusy, GrammarService
from engine.structured.limits import ConstraintError

MAX_FAILED_STEPS = 3  # consecutive steps in which nothing succeeded: the worker is at fault

log = logging.getLogger(__name__)


class FailedOnAnotherRank(RuntimeError):
    """This rank's part of a step went well, another rank's did not: all ranks fail it alike."""


class StepFaults(Protocol):
    """Hooks a test facility uses to make sequences misbehave (engine/testing)."""

    def watch(self, new_seq: SequenceStart) -> None: ...

    def forget(self, seq_ids: Iterable[int]) -> None: ...

    def reset(self) -> None: ...

    def trip(self, chunks: Sequence[SeqChunk]) -> None: ...

    def trip_late(self, chunks: Sequence[SeqChunk]) -> None: ...


class NoFaults:
    """Every step runs as the model runs it."""

    def watch(self, new_seq: SequenceStart) -> None:
        pass

    def forget(self, seq_ids: Iterable[int]) -> None:
        pass

    def reset(self) -> None:
        pass

    def trip(self, chunks: Sequence[SeqChunk]) -> None:
        pass

    def trip_late(self, chunks: Sequence[SeqChunk]) -> None:
        pass


class StepExecutor:
    def __init__(
        self,
        runner: ModelRunner,
        rank: int,
        faults: StepFaults | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        """`drafter`: speculative decoding's draft model (rank 0 of a group of one)."""
        self.runner = runner
        self.rank = rank  # only rank 0 samples and reports
        self.faults = faults or NoFaults()
        self.drafter = drafter
        self._num_draft: dict[int, int] = {}  # this step's draft lengths by sequence id
        self._failed_steps = 0
        config = runner.config
        # Compiled grammars and the tokenizer outlive a scheduler restart (they depend only on
        # the model); only rank 0 samples, so only it compiles.
        self.grammars = (
            GrammarService(runner.model_path, config.vocab_size, list(config.eos_token_ids))
            if rank == 0
            else None
        )
        self.reset_sequences()

    def reset_sequences(self) -> None:
        """Forget every sequence (a restarted scheduler announces them all again)."""
        config = self.runner.config
        self.sampler = Sampler(
            config.vocab_size,
            list(config.eos_token_ids),
            self.grammars,
            self.runner.backend.argmax_rows,
        )
        self.scoring = PromptScoring()
        self.pooling = Pooling()
        self.known = KnownSequences()
        self.faults.reset()
        if self.drafter is not None:
            self.drafter.reset()

    def compiling(self, plan: StepPlan) -> list[Future[Any]]:
        """The grammars the plan's new requests need that are still compiling (their compiles
        start now if they had not)."""
        if self.grammars is None:
            return []
        specs = [r.params.structured_outputs for r in plan.new_requests]
        found = [self.grammars.compile(spec) for spec in specs if spec is not None]
        return [future for future in found if not future.done()]

    def run(self, plan: StepPlan) -> list[StepResult | WorkerFailed]:
        """The step's messages for the scheduler: WorkerFailed for sequences that could not be
        computed (if any), then the StepResult (none for a plan that only retires sequences)."""
        self.sampler.remove(plan.finished_seq_ids)
        self.scoring.forget(plan.finished_seq_ids)
        self.pooling.forget(plan.finished_seq_ids)
        self.faults.forget(plan.finished_seq_ids)
        starts, whole_chunks = self.known.apply(plan)
        if self.drafter is not None:
            self.drafter.forget([*plan.finished_seq_ids, *(s.seq_id for s in starts)])
            self._num_draft = {c.seq_id: c.num_draft for c in plan.chunks if c.num_draft}
        failed: dict[int, Exception] = {}
        for new_seq in starts:
            try:
                self.sampler.add(new_seq)
                self.scoring.watch(new_seq)
                self.pooling.watch(new_seq)
                self.faults.watch(new_seq)
            except Exception as exc:  # this sequence's parameters, not the step's
                failed[new_seq.seq_id] = exc
        result = None
        if whole_chunks:
            chunks = [chunk for chunk in whole_chunks if chunk.seq_id not in failed]
            try:
                result = self._compute(plan.step_id, chunks)
            except CollectiveError:
                raise  # a rank or its connection is gone: the group restarts, requests resume
            except Exception as exc:
                result = self._isolate(plan.step_id, chunks, exc, failed)
            computed = any(chunk.seq_id not in failed for chunk in chunks)
            ours = [exc for exc in failed.values() if _status(exc) == 500]
            self._failed_steps = self._failed_steps + 1 if ours and not computed else 0
            if self._failed_steps >= MAX_FAILED_STEPS:
                raise RuntimeError(
                    f"{MAX_FAILED_STEPS} steps in a row failed with nothing computed; "
                    f"last: {_describe(ours[-1])}"
                )
        messages: list[StepResult | WorkerFailed] = [
            WorkerFailed(plan.step_id, [seq_id], _describe(exc), _status(exc))
            for seq_id, exc in failed.items()
        ]
        if result is not None:
            messages.append(result)
        return messages

    def _compute(self, step_id: int, chunks: Sequence[SeqChunk]) -> StepResult:
        if self.drafter is not None:  # first: the proposals move later chunks' token rows
            chunks = self.drafter.propose(chunks, self._num_draft, self.sampler)
        every_row = self.scoring.every_row(chunks)
        # Only rank 0 answers, so only it reads hidden states to pool.
        pooling = self.pooling.plan(chunks) if self.rank == 0 else PoolingStep([], [])
        try:
            self.faults.trip(chunks)
            prepared = self.runner.prepare(chunks, every_row)
        except Exception as exc:
            self._agree(exc)
            raise
        self._agree(None)
        try:
            logits, hidden = self.runner.execute_pooled(prepared, pooling.rows)
        except CollectiveError:
            raise
        except Exception as exc:
            if self.runner.group.size == 1:
                raise
            raise CollectiveError(
                f"rank {self.rank} failed inside the model, where its peers may wait in a "
                f"collective: {_describe(exc)}"
            ) from exc
        try:  # only rank 0 has work here; the sampler records a token only once it succeeded
            embeddings = self.pooling.pool(pooling, hidden)
            result = self._sample(step_id, chunks, every_row, logits)
            result.embeddings = embeddings or None
        except Exception as exc:
            self._agree(exc)
            raise
        self._agree(None)
        self.pooling.commit()
        if self.drafter is not None:
            self.drafter.settle(chunks, result.seq_ids)
        return result

    def _sample(
        self,
        step_id: int,
        chunks: Sequence[SeqChunk],
        every_row: set[int],
        logits: torch.Tensor,
    ) -> StepResult:
        if self.rank != 0:  # tensor parallelism: the logits, and sampling, are rank 0's
            return StepResult(step_id, [], [], None)
        self.faults.trip_late(chunks)
        logits, scored = self.scoring.split(chunks, every_row, logits)
        sampled = [chunk for chunk in chunks if chunk.sample]
        if not sampled:
            return StepResult(step_id, [], [], None, scored or None)
        if any(chunk.num_proposed for chunk in sampled):
            draft_probs = None if self.drafter is None else self.drafter.probs
            seq_ids, token_ids, logprobs = verify_proposals(
                self.sampler, sampled, logits, draft_probs
            )
        else:
            seq_ids = [chunk.seq_id for chunk in sampled]
            token_ids, logprobs = self.sampler.sample(seq_ids, logits)
        return StepResult(step_id, seq_ids, token_ids, logprobs, scored or None)

    def _agree(self, error: Exception | None) -> None:
        """Every rank learns whether any rank's part failed; then all fail, or none does."""
        failed = self.runner.group.failed_ranks(error is not None)
        if failed and error is None:
            raise FailedOnAnotherRank(f"the step failed on tensor-parallel rank(s) {failed}")

    def _isolate(
        self,
        step_id: int,
        chunks: Sequence[SeqChunk],
        error: Exception,
        failed: dict[int, Exception],
    ) -> StepResult:
        """Run a failed step's chunks one at a time; those that fail alone go to `failed`."""
        log.warning(
            "step %d failed (%s): running its %d sequence(s) one at a time",
            step_id,
            _describe(error),
            len(chunks),
        )
        parts: list[StepResult] = []
        for chunk in chunks:
            try:
                parts.append(self._compute(step_id, [chunk]))
            except CollectiveError:
                raise
            except Exception as exc:
                failed[chunk.seq_id] = exc
        ours = [exc for exc in failed.values() if _status(exc) == 500]
        if len(chunks) > 1 and not parts and ours:
            raise error  # every sequence fails alone: the worker is broken, not the requests
        described = {seq_id: _describe(exc) for seq_id, exc in failed.items()}
        log.error("step %d: sequences %s failed alone: %s", step_id, sorted(failed), described)
        return _merge(step_id, parts)


def _merge(step_id: int, parts: list[StepResult]) -> StepResult:
    """One StepResult from per-sequence ones (logprobs for all rows if any part has them)."""
    seq_ids = [seq_id for part in parts for seq_id in part.seq_ids]
    token_ids = [token_id for part in parts for token_id in part.token_ids]
    scored = [scores for part in parts for scores in part.prompt_logprobs or []]
    pooled = [vector for part in parts for vector in part.embeddings or []] or None
    if all(part.logprobs is None for part in parts):
        return StepResult(step_id, seq_ids, token_ids, None, scored or None, embeddings=pooled)
    logprobs: list[SampledLogprobs] = []
    for part in parts:
        # Rows of sequences that did not ask for logprobs are never read: placeholders do.
        logprobs += part.logprobs or [SampledLogprobs(0.0, [], []) for _ in part.seq_ids]
    return StepResult(step_id, seq_ids, token_ids, logprobs, scored or None, embeddings=pooled)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ConstraintError | GrammarsBusy):  # told as such, not as a crash
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _status(exc: BaseException) -> int:
    """400 for a constraint the grammar library stopped on (the request's fault), 503 for a
    grammar still compiling behind others (the server is busy), else 500."""
    if isinstance(exc, ConstraintError):
        return 400
    return 503 if isinstance(exc, GrammarsBusy) else 500
