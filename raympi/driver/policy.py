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
from typing import TYPE_CHECKING, Any, Union

from raympi.driver.run_state import Phase, RunState
from raympi.exceptions import (
    CapacityError,
    FormationError,
    PreemptedError,
    RaympiError,
    RestartsExhaustedError,
    StepTimeoutError,
    WorkerLostError,
)

if TYPE_CHECKING:
    from raympi.driver.config import FitConfig

__all__ = [
    "Capacity",
    "Cold",
    "Decision",
    "Failed",
    "Failure",
    "FailureKind",
    "Finish",
    "Grow",
    "Raise",
    "Warm",
    "decide",
]


class FailureKind(str, enum.Enum):
    """Why the pipeline stopped: infrastructure failures, user errors and planned stops."""

    WORKER_LOST = "worker_lost"  # an actor or its node died
    HUNG = "hung"  # a rank stopped answering, made no progress within step_timeout_s, or hung as it started
    COLLECTIVE = "collective"  # MPI reported a failed collective; which peer is not known
    FORMATION = "formation"  # starting or joining a new group failed
    USER_ERROR = "user_error"  # the model, loss or data raised: never retried
    PREEMPTED = "preempted"  # SIGTERM to a worker: checkpoint taken, re-form without it
    DRIVER_SIGTERM = "driver_sigterm"  # SIGTERM to the driver: checkpoint taken, stop
    CAPACITY_BACK = "capacity_back"  # checkpoint taken, the cluster has room for a larger group
    REPLACEMENT_READY = "replacement_ready"  # a replacement started earlier can join now
    EARLY_STOP = "early_stop"  # a callback asked to stop: checkpoint taken, finish normally
    # far slower after a warm restart (seen: Ray busy re-placing a lost bundle): checkpoint taken, a fresh group
    DEGRADED = "degraded"
    NO_CAPACITY = "no_capacity"  # a restart found no way to host min_workers within restart_timeout_s
    # a rank computing far slower than its peers, chunk after chunk: checkpoint taken, a hot spare off its node
    # takes its place (raympi.driver.stragglers)
    STRAGGLER = "straggler"
    # ranks on a node being drained (a preemption notice): checkpoint taken, hot spares elsewhere take their
    # places before the deadline (raympi.driver.drains)
    NODE_DRAIN = "node_drain"

    @property
    def planned(self) -> bool:
        """Stops that take a checkpoint of the step reached before anything else happens."""
        return self in (
            FailureKind.PREEMPTED,
            FailureKind.DRIVER_SIGTERM,
            FailureKind.CAPACITY_BACK,
            FailureKind.EARLY_STOP,
            FailureKind.DEGRADED,
            FailureKind.STRAGGLER,
            FailureKind.NODE_DRAIN,
        )

    @property
    def migration(self) -> bool:
        """Whether it moves ranks off a slow or draining node (a spare on that node never takes their place)."""
        return self in (FailureKind.STRAGGLER, FailureKind.NODE_DRAIN)

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
        warm_skipped: set on the follow-up of a warm restart that could not be carried out: why.
        resume: with ``warm_skipped``: ``(step, state ref, history)`` of the survivors, when they
            were still whole, for the cold restart to start from instead of an older checkpoint.
        world_before: on a follow-up, the group's size when the first failure was seen.
    """

    kind: FailureKind
    cause: str
    ranks: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()
    chunks: tuple[Any, ...] = ()
    error: BaseException | None = None
    phase: Phase = Phase.RUNNING
    warm_skipped: str | None = None
    resume: tuple[int, Any, Any] | None = None
    world_before: int | None = None
    report: str | None = None  # each rank's place and stacks, for the run's folder (a hang)

    @property
    def followup(self) -> bool:
        """Whether it comes out of carrying out an earlier decision (its failure was noticed already)."""
        return self.warm_skipped is not None or self.kind is FailureKind.NO_CAPACITY

    def as_error(self) -> RaympiError:
        """The public exception that stands for this failure."""
        if isinstance(self.error, RaympiError):
            return self.error
        kind = {
            FailureKind.HUNG: StepTimeoutError,
            FailureKind.FORMATION: FormationError,
            FailureKind.NO_CAPACITY: CapacityError,
        }.get(self.kind, WorkerLostError)
        return kind(self.cause)


class Failed(Exception):
    """Internal: carries a :class:`Failure` from where it is seen (the worker group) to the controller."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.cause)
        self.failure = failure


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


#: The five decisions :func:`decide` may return.
Decision = Union[Warm, Cold, Grow, Finish, Raise]


def resume_hint(run: RunState) -> str:
    """How to go on after a run that gave up: from its newest checkpoint, when it has one."""
    if run.newest is None:
        return "No checkpoint was written before it (checkpoint_every=N keeps one every N steps)"
    return f"The newest checkpoint is {run.newest.path}: fit(..., resume=True) continues from it"


def decide(failure: Failure, run: RunState, config: "FitConfig", capacity: Capacity) -> Decision:
    """What to do about ``failure``.

    Args:
        failure: what happened.
        run: the run's state (read: ``failures``, ``newest``, ``warm_possible``).
        config: the run's options (read: ``max_restarts``, ``min_workers``).
        capacity: the current group's size and what the cluster could host.

    Returns:
        One of :class:`Warm`, :class:`Cold`, :class:`Grow`, :class:`Finish`, :class:`Raise`.
    """
    kind = failure.kind
    if kind in (FailureKind.USER_ERROR, FailureKind.NO_CAPACITY):
        return Raise(failure.as_error())
    if failure.warm_skipped is not None:  # the warm restart decided before could not be carried out
        return Cold()
    if kind is FailureKind.DRIVER_SIGTERM:
        if run.newest is None:
            return Raise(PreemptedError(f"{failure.cause} before any checkpoint was written: nothing to resume from"))
        return Raise(
            PreemptedError(
                f"{failure.cause} after step {run.newest.step}; checkpoint written to "
                f"{run.newest.path}: fit(..., resume=True) continues from it"
            )
        )
    if kind is FailureKind.REPLACEMENT_READY:
        return Grow()
    if kind is FailureKind.EARLY_STOP:
        return Finish()
    failed = tuple(sorted(set(failure.ranks)))
    survivors = tuple(r for r in range(capacity.world) if r not in failed)
    room = max(0, capacity.cluster - len(survivors))  # where replacements could start
    warm = (
        run.warm_possible
        and bool(failed)
        and bool(survivors)
        and kind is not FailureKind.FORMATION
        and len(survivors) + min(room, len(failed)) >= config.min_ranks
    )
    if (kind is FailureKind.PREEMPTED or kind.migration) and warm:  # replaced; its peers keep their state
        return Warm(survivors=survivors, failed=failed)
    # PREEMPTED, STRAGGLER or NODE_DRAIN with too few left, CAPACITY_BACK, DEGRADED (DRIVER_SIGTERM: above)
    if kind.planned:
        return Cold(planned=True)
    if run.failures >= config.max_restarts:
        return Raise(
            RestartsExhaustedError(
                f"training failed {run.failures + 1} times, more than max_restarts={config.max_restarts}; "
                f"last failure: {failure.cause}. {resume_hint(run)}"
            )
        )
    return Warm(survivors=survivors, failed=failed) if warm else Cold()
