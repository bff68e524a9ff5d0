"""The failure policy: what the driver does about a failure, as one pure function.

:func:`decide` reads a :class:`Failure` (what went wrong, seen where it happened), the run's
:class:`~raympi.driver.run_state.RunState`, the options and the cluster's :class:`Capacity`, and
returns one decision: :class:`Warm`, :class:`Cold`, :class:`Grow`, :class:`Finish` or :class:`Raise`.  No Ray, no
I/O, no clock: it is tested as a table (``tests/test_policy.py``).  Carrying a decision out is
:mod:`raympi.driver.recovery`'s job.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Union

from raympi.exceptions import (
    FormationError, PreemptedError, RaympiError, RestartsExhaustedError, StepTimeoutError, WorkerLostError,
)

__all__ = ["Capacity", "Cold", "Decision", "Failure", "FailureKind", "Finish", "Grow", "PaceWatch", "Raise", "Warm", "decide"]


class FailureKind(str, enum.Enum):
    """Why the pipeline stopped: infrastructure failures, user errors and planned stops."""

    WORKER_LOST = "worker_lost"  # an actor or its node died
    HUNG = "hung"  # a rank made no progress within step_timeout_s
    COLLECTIVE = "collective"  # MPI reported a failed collective; which peer is not known
    FORMATION = "formation"  # starting or joining a new group failed
    USER_ERROR = "user_error"  # the model, loss or data raised: never retried
    PREEMPTED = "preempted"  # SIGTERM to a worker: checkpoint taken, re-form without it
    DRIVER_SIGTERM = "driver_sigterm"  # SIGTERM to the driver: checkpoint taken, stop
    CAPACITY_BACK = "capacity_back"  # checkpoint taken, the cluster has room for a larger group
    REPLACEMENT_READY = "replacement_ready"  # a replacement started earlier can join now
    EARLY_STOP = "early_stop"  # a callback asked to stop: checkpoint taken, finish normally
    DEGRADED = "degraded"  # far slower after a warm restart (MPI left sick): checkpoint taken, a fresh group

    @property
    def planned(self) -> bool:
        """Stops that take a checkpoint of the step reached before anything else happens."""
        return self in (FailureKind.PREEMPTED, FailureKind.DRIVER_SIGTERM, FailureKind.CAPACITY_BACK, FailureKind.EARLY_STOP,
                        FailureKind.DEGRADED)

    @property
    def counted(self) -> bool:
        """Whether it spends the ``max_restarts`` budget (infrastructure failures do, planned stops do not)."""
        return self in (FailureKind.WORKER_LOST, FailureKind.HUNG, FailureKind.COLLECTIVE, FailureKind.FORMATION)


@dataclasses.dataclass(frozen=True)
class Failure:
    """A failure or planned stop, built where it was seen.

    Attributes:
        kind: what happened.
        cause: one line for logs and the restart record.
        ranks: the ranks that failed (empty when not known).
        nodes: the Ray node ids of those ranks.
        chunks: the chunks of steps in flight when it happened (survivors may still report them).
        error: the exception to raise when the run stops over it (user errors, driver SIGTERM).
        phase: the controller's phase when it was seen.
    """

    kind: FailureKind
    cause: str
    ranks: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()
    chunks: tuple[Any, ...] = ()
    error: BaseException | None = None
    phase: str = "running"

    def as_error(self) -> RaympiError:
        """The public exception that stands for this failure."""
        if isinstance(self.error, RaympiError):
            return self.error
        kind = {FailureKind.HUNG: StepTimeoutError, FailureKind.FORMATION: FormationError}.get(self.kind, WorkerLostError)
        return kind(self.cause)


class Failed(Exception):
    """Internal: carries a :class:`Failure` from where it is seen (the worker group) to the controller."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.cause)
        self.failure = failure


class PaceWatch:
    """Notices a group that runs far slower after a warm restart than before it.

    A survivor's MPI library can be left sick by a peer that died mid-collective (seen here: MPICH
    over UCX after a node loss, every step ~15x slower).  Fed each chunk's samples/s, it learns the
    pace (a moving average) while no restart is being watched, and for ``watch`` chunks after a warm
    restart reports the slowdown once ``chunks`` chunks in a row ran ``factor`` times slower.
    """

    def __init__(self, factor: float = 5.0, chunks: int = 3, watch: int = 12) -> None:
        self.factor, self.chunks, self.watch = factor, chunks, watch
        self.pace: float | None = None
        self._left = self._slow = 0

    def restarted(self) -> None:
        """A warm restart happened: watch the chunks that follow."""
        self._left, self._slow = self.watch, 0

    def observe(self, rate: float) -> float | None:
        """Take one chunk's samples/s; returns how many times slower the group is when it is degraded."""
        if not self._left:
            self.pace = rate if self.pace is None else 0.8 * self.pace + 0.2 * rate
            return None
        self._left -= 1
        self._slow = self._slow + 1 if self.pace and rate * self.factor < self.pace else 0
        if self._slow < self.chunks:
            return None
        self._left = 0
        return self.pace / max(rate, 1e-9)


@dataclasses.dataclass(frozen=True)
class Capacity:
    """What the cluster offers right now.

    Attributes:
        world: ranks in the current group (0 when there is none).
        cluster: workers the live nodes could host in all (survivors included).
    """

    world: int
    cluster: int


@dataclasses.dataclass(frozen=True)
class Warm:
    """Survivors abandon the step in flight, keep their state and re-form with replacements."""

    survivors: tuple[int, ...]
    failed: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Cold:
    """Kill the group, start a new one of what the cluster can host, restore the newest checkpoint.

    ``planned``: a checkpoint of the current step was just taken, nothing is lost.
    """

    planned: bool = False


@dataclasses.dataclass(frozen=True)
class Grow:
    """Take the replacements that are ready into the running group (warm, state by broadcast)."""


@dataclasses.dataclass(frozen=True)
class Finish:
    """End the run normally (a callback stopped it early; its checkpoint is taken)."""


@dataclasses.dataclass(frozen=True)
class Raise:
    """Stop the run with ``error``."""

    error: BaseException


Decision = Union[Warm, Cold, Grow, Finish, Raise]


def decide(failure: Failure, run: Any, config: Any, capacity: Capacity) -> Decision:
    """What to do about ``failure``.

    Args:
        failure: what happened.
        run: the :class:`~raympi.driver.run_state.RunState` (read: ``failures``, ``newest``, ``warm_possible``).
        config: the run's options (read: ``max_restarts``, ``min_workers``).
        capacity: the current group's size and what the cluster could host.

    Returns:
        One of :class:`Warm`, :class:`Cold`, :class:`Grow`, :class:`Finish`, :class:`Raise`.
    """
    kind = failure.kind
    if kind is FailureKind.USER_ERROR:
        return Raise(failure.as_error())
    if kind is FailureKind.DRIVER_SIGTERM:
        if run.newest is None:
            return Raise(PreemptedError(f"{failure.cause} before any checkpoint was written: nothing to resume from"))
        return Raise(PreemptedError(f"{failure.cause} after step {run.newest.step}; checkpoint written to "
                                    f"{run.newest.path}: fit(..., resume=True) continues from it"))
    if kind is FailureKind.REPLACEMENT_READY:
        return Grow()
    if kind is FailureKind.EARLY_STOP:
        return Finish()
    failed = tuple(sorted(set(failure.ranks)))
    survivors = tuple(r for r in range(capacity.world) if r not in failed)
    room = max(0, capacity.cluster - len(survivors))  # where replacements could start
    warm = (run.warm_possible and bool(failed) and bool(survivors) and kind is not FailureKind.FORMATION
            and len(survivors) + min(room, len(failed)) >= config.min_workers)
    if kind is FailureKind.PREEMPTED and warm:  # the preempted rank is replaced, its peers keep their state
        return Warm(survivors=survivors, failed=failed)
    if kind.planned:  # PREEMPTED without survivors, CAPACITY_BACK, DEGRADED (DRIVER_SIGTERM was handled above)
        return Cold(planned=True)
    if run.failures >= config.max_restarts:
        newest = run.newest.path if run.newest else None
        return Raise(RestartsExhaustedError(
            f"training failed {run.failures + 1} times, more than max_restarts={config.max_restarts}; last failure: "
            f"{failure.cause}. The newest checkpoint is {newest}: fit(..., resume=True) continues from it"))
    return Warm(survivors=survivors, failed=failed) if warm else Cold()
