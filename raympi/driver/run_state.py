"""``RunState``: everything one ``fit()`` run knows about its progress, as one frozen value.

The controller owns it and replaces it (``dataclasses.replace``) at each transition; nothing else
writes it.  The data cursor is ``start_step`` plus the steps recorded in ``history``.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

__all__ = ["Checkpoint", "Phase", "RunState"]


class Phase(str, enum.Enum):
    """Where the controller is; logged at each change and written into restart records."""

    STARTING = "starting"  # placing, starting and joining a group
    RUNNING = "running"  # chunks of steps in flight
    DRAINING = "draining"  # no new chunks: finishing those in flight before a planned stop
    RECOVERING = "recovering"  # carrying out a decision of the failure policy
    DONE = "done"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The newest checkpoint on storage and what a cold restart starts from: its state in driver
    memory, or (a large state rank 0 wrote itself) a ``StoredState`` naming the file and its checksum,
    which the workers read from storage."""

    step: int
    path: str | None
    state: Any


@dataclasses.dataclass(frozen=True)
class RunState:
    """One run's progress.

    Attributes:
        phase: the controller's phase.
        start_step: the step the current group started from (the cursor after a restart).
        history: one metrics record per completed step.
        restarts: one record per recovery (and per planned re-formation).
        failures: infrastructure failures survived so far (the ``max_restarts`` budget).
        newest: the newest checkpoint written, or ``None``.
        warm_possible: whether survivors can keep their state (not with a Ray Dataset).
    """

    phase: Phase = Phase.STARTING
    start_step: int = 0
    history: tuple[dict[str, Any], ...] = ()
    restarts: tuple[dict[str, Any], ...] = ()
    failures: int = 0
    newest: Checkpoint | None = None
    warm_possible: bool = True

    @property
    def step(self) -> int:
        """The last completed step."""
        return self.history[-1]["step"] if self.history else self.start_step

    def until(self, step: int) -> tuple[dict[str, Any], ...]:
        """The history up to and including ``step``."""
        return tuple(r for r in self.history if r["step"] <= step)
