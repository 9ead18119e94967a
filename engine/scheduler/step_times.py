"""Where a running batch's time goes: each step's compute on rank 0, and the gaps between steps.

Exactly one step is in flight at a time, so the workers idle from the moment rank 0's result is
ready until the next plan reaches them: the result crosses the "results" ring, the scheduler
updates and plans, the plan crosses the "plan" ring. Rank 0 stamps every StepResult with when it
took the plan in and when the result was ready (one monotonic clock for every process of the
machine); the scheduler actor notes how long it took from reading a result to making the plan
that follows it (before sending it: a rank may take a plan in before the send returns, and the
scheduler's part must lie inside the gap). A gap is counted only for a plan made right after a
result (a plan made when a request arrives at an idle scheduler follows no step).
"""

from __future__ import annotations

from engine.messages.steps import StepResult


class StepTimes:
    def __init__(self) -> None:
        self.compute_seconds = 0.0
        self.gaps = 0
        self.gap_seconds = 0.0
        self.gap_scheduler_seconds = 0.0
        self._previous_finished_at = 0.0  # when the latest result was ready on rank 0
        # The plan made right after the latest result: its step id and the scheduler's seconds.
        self._follow_on: tuple[int, float] | None = None

    def on_result(self, result: StepResult) -> None:
        if result.finished_at <= 0.0:  # not stamped
            return
        self.compute_seconds += result.finished_at - result.started_at
        if self._follow_on is not None and self._follow_on[0] == result.step_id:
            self.gaps += 1
            self.gap_seconds += max(0.0, result.started_at - self._previous_finished_at)
            self.gap_scheduler_seconds += self._follow_on[1]
        self._follow_on = None
        self._previous_finished_at = result.finished_at

    def planned_after_result(self, step_id: int, read_at: float, planned_at: float) -> None:
        """The plan `step_id` was made at `planned_at`, after a result read at `read_at`."""
        self._follow_on = (step_id, planned_at - read_at)

    def figures(self) -> dict[str, float | int]:
        """SchedulerFigures' step_* fields."""
        return {
            "step_compute_seconds": self.compute_seconds,
            "step_gaps": self.gaps,
            "step_gap_seconds": self.gap_seconds,
            "step_gap_scheduler_seconds": self.gap_scheduler_seconds,
        }
