"""What a worker's calls return to the driver: small frozen values, pickled by Ray."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["ChunkResult", "Evaluated", "Rejoined"]


@dataclasses.dataclass(frozen=True)
class ChunkResult:
    """One chunk of steps on one rank (:meth:`raympi.worker.Worker.run`).

    Attributes:
        metrics: one record per step taken.
        step: the step of the state held now.
        aborted: a collective was abandoned (a peer failed): the chunk ended early, at the last whole step.
        sigterm: the rank's process was sent SIGTERM (its node is being preempted).
    """

    metrics: list[dict[str, Any]]
    step: int
    aborted: bool = False
    sigterm: bool = False


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
