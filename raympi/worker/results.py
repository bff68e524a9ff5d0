"""What a worker's calls return to the driver: small frozen values, pickled by Ray."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["ChunkResult", "Evaluated", "Rejoined", "StepTimes", "Where"]


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """Where one rank's time went over a chunk of steps, in seconds.

    Attributes:
        data_s: waiting for the next batch (reading, augmenting, copying it to the device).
        compute_s: the step itself, less its waits for collectives.
        collective_s: waiting for collectives to complete (for the peers, and the transfer).
    """

    data_s: float = 0.0
    compute_s: float = 0.0
    collective_s: float = 0.0

    @property
    def total_s(self) -> float:
        """The chunk's time on this rank."""
        return self.data_s + self.compute_s + self.collective_s


@dataclasses.dataclass(frozen=True)
class Where:
    """Where a rank is now (:meth:`raympi.worker.Worker.where`, answered from its health thread).

    Attributes:
        step: the step of the state it holds.
        activity: ``"data"`` (waiting for a batch), ``"compute"`` (in the step, outside collectives),
            ``"collective"`` (waiting in one for its peers), or ``"idle"`` (between calls).
        since_s: how long it has been at it.
    """

    step: int
    activity: str
    since_s: float


@dataclasses.dataclass(frozen=True)
class ChunkResult:
    """One chunk of steps on one rank (:meth:`raympi.worker.Worker.run`).

    Attributes:
        metrics: one record per step taken.
        step: the step of the state held now.
        aborted: a collective was abandoned (a peer failed): the chunk ended early, at the last whole step.
        sigterm: the rank's process was sent SIGTERM (its node is being preempted).
        times: where the rank's time went over the chunk.
    """

    metrics: list[dict[str, Any]]
    step: int
    aborted: bool = False
    sigterm: bool = False
    times: StepTimes = StepTimes()


@dataclasses.dataclass(frozen=True)
class Evaluated:
    """One rank's evaluation (:meth:`raympi.worker.Worker.evaluate`).

    Attributes:
        metrics: the global means, on rank 0; ``None`` on the others.
        aborted: a collective was abandoned (a peer failed).
    """

    metrics: dict[str, float] | None = None
    aborted: bool = False


@dataclasses.dataclass(frozen=True)
class Rejoined:
    """A rank's answer once a re-formed group gave it the state (:meth:`raympi.worker.Worker.rejoin`).

    Attributes:
        step: the step of the state now held.
        unusable: why the survivors' slices of a sharded state do not make one state (every rank says
            the same); ``None`` when the state is whole.
    """

    step: int
    unusable: str | None = None
