"""What a supervisor keeps of each of its children between generations."""

from __future__ import annotations

from dataclasses import dataclass

from engine.actors.runtime.child_process import ChildProcess
from engine.actors.runtime.child_spec import ChildSpec
from engine.actors.runtime.events import ChildStatus


@dataclass
class SupervisedChild:
    spec: ChildSpec
    process: ChildProcess | None = None  # the current generation's, if any
    state: str = "stopped"
    spawned: int = 0  # generations started so far
    restarts: int = 0
    last_restart_reason: str = ""

    def status(self) -> ChildStatus:
        process = self.process
        return ChildStatus(
            name=self.spec.name,
            entry=self.spec.entry,
            role=self.spec.role,
            group=self.spec.group,
            pid=process.pid if process is not None and process.alive else None,
            state=self.state,
            generation=process.generation if process is not None else 0,
            restarts=self.restarts,
            last_restart_reason=self.last_restart_reason,
            decode_errors=process.decode_errors if process is not None else 0,
        )
