"""Recovery actions: carrying out a decision of :func:`raympi.driver.policy.decide`.

Plain functions of (group, run state, options): :func:`warm` re-forms the survivors with
replacements and keeps their state, :func:`cold` starts a new group from the newest checkpoint,
:func:`grow` takes ready replacements into a running group.  Each returns the new
:class:`~raympi.driver.run_state.RunState` (with its restart record) and never decides anything:
when an action cannot be carried out it raises, and the controller asks the policy again.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Callable

import ray

from raympi.deadline import Deadline, Expired
from raympi.driver.config import FitConfig
from raympi.driver.group import LOST, WorkerGroup
from raympi.driver.policy import Failed, Failure, FailureKind, Warm, resume_hint
from raympi.driver.run_state import History, Phase, RestartRecord, RunState
from raympi.exceptions import CapacityError, FormationError

__all__ = ["INFRASTRUCTURE_ERRORS", "NoCapacity", "WarmSkipped", "cold", "grow", "record_of", "warm"]


class WarmSkipped(Exception):
    """The warm path could not be carried out (the message says why): the controller asks the policy again.

    ``resume``: ``(step, state ref, history)`` of the survivors when they were still whole (re-forming
    failed), for the cold restart to start from instead of the older checkpoint.
    """

    def __init__(self, message: str, resume: tuple[int, Any, History] | None = None) -> None:
        super().__init__(message)
        self.resume = resume

    def followup(self, failure: Failure, world: int) -> Failure:
        """The failure to decide on again: the same one, marked as a warm restart given up (by a group of ``world``)."""
        return dataclasses.replace(
            failure, warm_skipped=str(self), resume=self.resume, phase=Phase.RECOVERING, world_before=world
        )


class NoCapacity(Exception):
    """A cold restart found no way to host ``min_workers`` within ``restart_timeout_s`` (the message says why)."""

    def followup(self, failure: Failure) -> Failure:
        """The failure to decide on again (the policy stops the run with a :class:`CapacityError`)."""
        return Failure(
            FailureKind.NO_CAPACITY,
            str(self),
            ranks=failure.ranks,
            nodes=failure.nodes,
            phase=Phase.RECOVERING,
            world_before=failure.world_before,
        )


# What re-forming a group or starting one may raise when the cluster, not our code, is at fault.
INFRASTRUCTURE_ERRORS = (CapacityError, FormationError, Failed, Expired, ray.exceptions.RayError)


def record_of(failure: Failure, run: RunState, world: int) -> RestartRecord:
    """A restart record's first fields: what failed, when, and in which phase."""
    return RestartRecord(
        time=time.time(),
        step=run.step,
        ranks=tuple(failure.ranks),
        nodes=tuple(failure.nodes),
        cause=failure.cause,
        kind=failure.kind.value,
        phase=failure.phase.value,
        world_before=world,
        warm_skipped=failure.warm_skipped,
        report=failure.report,
    )


def _append(run: RunState, record: RestartRecord, failure: Failure | None, **changes: Any) -> RunState:
    counted = failure is not None and failure.kind.counted
    return dataclasses.replace(run, restarts=(*run.restarts, record), failures=run.failures + counted, **changes)


def warm(
    group: WorkerGroup, decision: Warm, failure: Failure, run: RunState, cfg: FitConfig, steps_per_epoch: int
) -> RunState:
    """Survivors abandon the step in flight and keep their state; replacements join by broadcast.

    Only the step in flight is lost.  Raises :class:`WarmSkipped` when a survivor does not stop in
    time, fails as well, or re-forming fails (the group is then for the cold path to tear down).
    """
    record = record_of(failure, run, group.world)
    failed, survivors = list(decision.failed), list(decision.survivors)
    group.abort(survivors)
    # Replacements boot while the survivors drain; a slow or draining node holds no spare that may take its place.
    group.replace(failed, avoid=frozenset(failure.nodes) if failure.kind.migration else frozenset())
    deadline = Deadline(cfg.step_timeout_s, "step_timeout_s")
    reported: dict[int, dict[str, Any]] = {}
    done = {r: run.step for r in survivors}
    for chunk in failure.chunks:
        try:
            outcomes = group.outcomes({r: chunk.refs[r] for r in survivors}, deadline.remaining())
        except ray.exceptions.RayError as error:
            raise WarmSkipped(f"a survivor failed: {type(error).__name__}") from None
        if outcomes is None:
            raise WarmSkipped(f"a survivor did not stop within {deadline.setting}")
        for r, res in outcomes.items():
            if res is LOST:
                failed.append(r)
                group.replace([r])
                continue
            done[r] = res.step
            for k, metrics in enumerate(res.metrics):
                reported[chunk.first + k + 1] = metrics
        survivors = [r for r in survivors if r not in failed]
        if not survivors:
            raise WarmSkipped("no survivor left")
    root = max(survivors, key=lambda r: done[r])
    step, world_before = done[root], group.world
    how = f"planned migration at step {step}, {len(survivors)} rank(s) kept" if failure.kind.migration else None
    print(
        f"raympi: {failure.cause}; {how or f'warm restart of {len(survivors)} survivor(s) at step {step}'}",
        file=sys.stderr,
    )
    # Steps the survivors finished but the driver had not seen yet: their metrics as the survivors
    # reported them, marked as reconstructed (their time is when the driver learnt of them).
    seen = [
        {
            "step": s,
            "epoch": (s - 1) // steps_per_epoch,
            **reported.get(s, {}),
            "world_size": world_before,
            "time": time.time(),
            "reconstructed": True,
        }
        for s in range(run.step + 1, step + 1)
    ]
    history = run.until(step).append(seen)
    # Taken from the root's health thread while it re-forms; used only if re-forming fails.  A sharded
    # state is not one rank's: re-forming failed, the run restarts from the newest checkpoint.
    snapshot = None if cfg.shard_optimizer else group.snapshot(root)
    try:
        group.reform(survivors, root, Deadline(cfg.restart_timeout_s, "restart_timeout_s"))
    except INFRASTRUCTURE_ERRORS as error:  # a cold restart follows, from the survivors' state if it was saved
        saved = snapshot is not None and group.holds(snapshot, Deadline(cfg.step_timeout_s).remaining())
        raise WarmSkipped(
            f"re-forming failed: {type(error).__name__}: {error}",
            resume=(step, snapshot, history) if saved else None,
        ) from None
    record = dataclasses.replace(
        record,
        path="warm",
        world_after=group.world,
        steps_lost=max(0, record.step - step),
        restored_step=step,
        reformed=group.reformed_by,
    )
    return _append(run, record, failure, history=history, step=step, start_step=step)


def cold(
    start_group: Callable[..., WorkerGroup],
    capacity: Callable[[dict[str, float]], int],
    bundle: dict[str, float],
    failure: Failure,
    run: RunState,
    cfg: FitConfig,
    world_before: int,
) -> tuple[WorkerGroup, RunState]:
    """A new group of as many workers as the cluster can host (``min_workers`` to ``workers``,
    waiting up to ``restart_timeout_s``), restored from the survivors' state when a warm restart
    given up saved it (``failure.resume``), else from the newest checkpoint in driver memory.

    ``start_group(world, state, place_timeout_s)`` builds a :class:`WorkerGroup`; ``capacity(bundle)``
    counts the workers the cluster could host.

    Raises:
        NoCapacity: no group of ``min_workers`` could be started within ``restart_timeout_s``.
        Failed: a worker of the new group failed in the user's code (the policy stops the run).
    """
    record = record_of(failure, run, world_before)
    step, state = (run.newest.step, run.newest.state) if run.newest else (0, None)
    history = run.until(step)
    if failure.resume:
        (step, state, history), record = failure.resume, dataclasses.replace(record, source="survivors")
    print(f"raympi: {failure.cause}; restarting from step {step}", file=sys.stderr)
    deadline = Deadline(cfg.restart_timeout_s, "restart_timeout_s")
    last_error: Exception | None = None
    cap = cfg.workers

    def attempt(world: int, place_timeout_s: float) -> tuple[WorkerGroup, RunState] | None:
        nonlocal last_error, cap
        try:
            group = start_group(world, state, place_timeout_s)
        except (CapacityError, FormationError, Failed) as error:  # a node went away meanwhile: count again
            if isinstance(error, Failed) and error.failure.kind is FailureKind.USER_ERROR:
                raise  # the policy's to decide on
            last_error = error
            # Ray may still count a cut-off node as alive: ask for one worker fewer next time
            # (a later checkpoint grows the group back once the capacity is real).
            cap = max(cfg.min_ranks, world - 1)
            return None
        done = dataclasses.replace(
            record, world_after=group.world, steps_lost=max(0, record.step - step), restored_step=step
        )
        return group, _append(run, done, failure, history=history, step=step, start_step=step)

    overran = False  # the last try started before the deadline and failed after it
    for remaining in deadline.backoff(first_s=0.05, most_s=1.0):
        world = min(cap, capacity(bundle))
        if world >= cfg.min_ranks:
            in_time = not deadline.expired()
            started = attempt(world, min(5.0, max(1.0, remaining)))
            if started:
                return started
            overran = in_time and deadline.expired()
    # The deadline bounds the wait for room: a try that started in time and failed past it (a worker hung as it
    # started, a formation cut short) earns one more, where there is room.
    if overran:
        world = min(cap, capacity(bundle))
        started = attempt(world, 5.0) if world >= cfg.min_ranks else None
        if started:
            return started
    why = (
        f"the cluster can host {world} worker(s) of {bundle}, fewer than min_workers={cfg.min_workers}"
        if world < cfg.min_ranks
        else f"re-forming {world} worker(s) kept failing (last: {last_error})"
    )
    raise NoCapacity(
        f"after the failure {why}, and no way forward was found within {deadline.setting}. {resume_hint(run)}"
    )


def grow(group: WorkerGroup, failure: Failure, run: RunState, cfg: FitConfig) -> RunState:
    """Take the replacements that are ready into the group (warm: rank 0's state by broadcast)."""
    record = dataclasses.replace(
        record_of(failure, run, group.world), path="warm", restored_step=run.step, steps_lost=0
    )
    group.reform(list(range(group.world)), 0, Deadline(cfg.restart_timeout_s, "restart_timeout_s"))
    return _append(run, dataclasses.replace(record, world_after=group.world, reformed=group.reformed_by), failure)
