"""The chunk pipeline: steps sent to the workers in chunks, two chunks in flight.

:class:`ChunkPlan` is the pure arithmetic (where a chunk must end, when to evaluate or take a
checkpoint, how large the next chunk is) and is tested without Ray.  :class:`Pipeline` runs chunks
on a worker group until the run is done or something stops it, and *returns* what stopped it as a
:class:`~raympi.driver.policy.Failure`; it never decides what to do about a failure.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any, Callable, Protocol

import torch

from raympi.deadline import Deadline
from raympi.driver.data import Sampler
from raympi.driver.policy import Failed, Failure, FailureKind
from raympi.worker.results import StepTimes

__all__ = ["Chunk", "ChunkPlan", "Pipeline", "Hooks"]

CHUNK_SECONDS = 0.5  # target duration of one chunk of steps
MAX_CHUNK = 512


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """Where chunks end and what they carry, for a run of ``total`` steps."""

    total: int
    steps_per_epoch: int
    checkpoint_every: int = 0
    eval_every: int = 0
    has_eval: bool = False

    def boundary(self, step: int) -> int:
        """The first step after ``step`` at which something must happen (epoch end, eval, checkpoint, end)."""
        ends = [self.total, (step // self.steps_per_epoch + 1) * self.steps_per_epoch]
        for every in (self.checkpoint_every, self.eval_every if self.has_eval else 0):
            if every:
                ends.append((step // every + 1) * every)
        return min(ends)

    def wants_eval(self, step: int) -> bool:
        """Whether to evaluate after ``step``: every ``eval_every`` steps, else at each epoch's end and the last
        step."""
        if not self.has_eval:
            return False
        if self.eval_every:
            return step % self.eval_every == 0
        return step % self.steps_per_epoch == 0 or step == self.total

    def wants_checkpoint(self, step: int) -> bool:
        """Whether to take a checkpoint after ``step`` (every ``checkpoint_every`` steps, and the last one)."""
        return step == self.total or bool(self.checkpoint_every and step % self.checkpoint_every == 0)

    def next_size(self, step: int, last_count: int, last_seconds: float) -> int:
        """Steps in the chunk starting at ``step``: about ``CHUNK_SECONDS`` of work, never past a boundary."""
        size = max(1, min(MAX_CHUNK, int(CHUNK_SECONDS * last_count / max(1e-9, last_seconds))))
        return min(size, self.boundary(step) - step)


@dataclasses.dataclass
class Chunk:
    """Steps ``first+1 .. last`` in flight on every rank."""

    first: int
    last: int
    refs: list[Any]
    eval: list[Any] | None = None
    state: Any = None  # rank 0's state after ``last`` (a checkpoint), when asked for
    times: list[StepTimes] | None = None  # where each rank's time went, once done


class Hooks(Protocol):
    """What the pipeline tells its owner (the controller)."""

    def completed(self, chunk: Chunk, records: list[dict[str, Any]]) -> Failure | None:
        """Steps are done; returns a planned stop to drain for, or None."""

    def save(self, state_ref: Any, step: int) -> Failure | None:
        """A checkpoint's state is ready; returns a planned stop to drain for, or None."""

    def draining(self, stop: Failure) -> None:
        """A planned stop was asked for: no new chunks until those in flight are done."""


class Pipeline:
    """Runs chunks of steps on a group; returns ``None`` when done or the :class:`Failure` that stopped it."""

    def __init__(
        self,
        plan: ChunkPlan,
        sampler: Sampler,
        cfg: Any,
        eval_size: int,
        snapshot: Callable[[Any, int], Any] | None = None,
    ) -> None:
        self.plan, self.sampler, self.cfg, self.eval_size = plan, sampler, cfg, eval_size
        # An evaluation (and checkpoint) a failure cut short: (step, that step's record, checkpoint wanted).
        # The next run from that step does them first, on the new group: the restart loses nothing.
        self.owed: tuple[int, dict[str, Any], bool] | None = None
        # How rank 0's state after a step is asked for (queued behind that step's chunk): by default an
        # object ref of the state; the checkpoint store may ask rank 0 to write a large one itself.
        self.snapshot = snapshot or (lambda group, step: group.actors[0].state_dict.remote())
        self.pace: tuple[int, float] | None = None  # the last chunk's steps and seconds, to size the next one

    def _evaluation(self, group: Any, step: int) -> list[Any]:
        """Every rank's evaluation of its part of the eval set, after ``step``."""
        parts = torch.tensor_split(torch.arange(self.eval_size), group.world)
        return [a.evaluate.remote(parts[r], self.cfg.eval_with_ema) for r, a in enumerate(group.actors)]

    def _evaluated(self, group: Any, refs: list[Any]) -> dict[str, Any]:
        """Rank 0's eval metrics; raises Failed when a rank died or hung, or a collective was abandoned."""
        results = group.gather(refs, Deadline(self.cfg.step_timeout_s, "step_timeout_s"), "evaluation", heartbeat=True)
        aborted = [r for r, res in enumerate(results) if res.aborted]
        if aborted:
            raise Failed(Failure(FailureKind.COLLECTIVE, f"evaluation: a collective failed on rank(s) {aborted}"))
        return dict(results[0].metrics or {})

    def _pay_owed(self, group: Any, start: int, hooks: Hooks) -> Failure | None:
        """The evaluation and checkpoint of step ``start`` that a failure cut short, on the new group;
        returns a planned stop asked for meanwhile.  Raises :class:`Failed` when it fails again."""
        owed, self.owed = self.owed, None
        if owed is None or owed[0] != start:
            return None  # training went back further: that step's chunk runs again, with them
        step, record, checkpoint = owed
        refs = self._evaluation(group, step)
        state = self.snapshot(group, step) if checkpoint else None
        try:
            metrics = self._evaluated(group, refs)
        except Failed:
            self.owed = owed
            raise
        stop = hooks.completed(Chunk(step, step, [], eval=refs), [{**record, **metrics, "time": time.time()}])
        if state is not None:
            stop = hooks.save(state, step) or stop
        return stop

    def submit(self, group: Any, first: int, count: int) -> Chunk:
        """Send steps ``first+1 .. first+count`` to every rank (indices only)."""
        world = group.world
        shards: list[list[tuple[int, Any]]] = [[] for _ in range(world)]
        for s in range(first, first + count):
            epoch = s // self.plan.steps_per_epoch
            for rank, part in enumerate(self.sampler.shards(s, world)):
                # As numpy: a tensor pickles through torch.save, 4x the driver's CPU (scale.py part b)
                shards[rank].append((epoch, part.numpy() if isinstance(part, torch.Tensor) else part))
        last = first + count
        chunk = Chunk(first, last, [a.run.remote(shards[r], self.cfg.batch_size) for r, a in enumerate(group.actors)])
        if self.plan.wants_eval(last):
            chunk.eval = self._evaluation(group, last)
        if self.plan.wants_checkpoint(last):
            chunk.state = self.snapshot(group, last)
        return chunk

    def run(self, group: Any, start: int, hooks: Hooks, stop_requested: Callable[[], Failure | None]) -> Failure | None:
        """Run from ``start`` to the plan's end.

        ``stop_requested()`` is asked before each submission (the driver's SIGTERM): a stop drains the
        chunks in flight, takes a checkpoint of the step reached, and returns the stop.
        """
        cfg, plan = self.cfg, self.plan
        inflight: deque[Chunk] = deque()
        # A group's first chunk is one step: a new group's warms up autograd and MPI, a re-formed one's says soon that
        # it is back.  The chunk sent with it is one step too in a new group, and at the last chunk's pace in a
        # re-formed one (which then needs no run of short chunks to find its pace again).
        size, then = 1, 1 if group.fresh or self.pace is None else plan.next_size(start, *self.pace)
        next_step, last_done = start, time.monotonic()
        stop: Failure | None = None

        def keep_first(new: Failure | None) -> Failure | None:
            """The first stop asked for wins (a SIGTERM is never overtaken by a later grow, say)."""
            if new is not None and stop is None:
                hooks.draining(new)
            return stop or new

        try:
            stop = keep_first(self._pay_owed(group, start, hooks))
        except Failed as failed:
            return failed.failure
        while next_step < plan.total or inflight:
            stop = keep_first(stop_requested())
            if stop is None:
                group.join_spares()  # a ready hot spare joins the standby communicator between two chunks
            while len(inflight) < 2 and next_step < plan.total and stop is None:
                count = min(size, plan.boundary(next_step) - next_step)
                inflight.append(self.submit(group, next_step, count))
                if next_step == start:  # the group's first chunk, sent
                    size = then
                next_step += count
            if not inflight:  # stopped before anything was sent (the SIGTERM came while starting)
                assert stop is not None  # (nothing sent, the plan not done: only a stop does that)
                return self._stopped(group, stop, next_step, hooks)
            chunk = inflight.popleft()
            # The first step of a new group also warms up autograd and MPI's connections: startup time
            # (not after a warm restart: survivors and spares have run their first steps already).
            first = chunk.first == start and group.fresh
            field = "startup_timeout_s" if first else "step_timeout_s"
            deadline = Deadline(getattr(cfg, field), field, start=max(last_done, time.monotonic()))
            # A rank stopped or cut off is found by the heartbeat long before the hard limit, the first
            # chunk's included (its health thread answers while the step warms up).
            try:
                results = group.gather(chunk.refs, deadline, f"steps {chunk.first + 1}-{chunk.last}", heartbeat=True)
            except Failed as failed:
                return dataclasses.replace(failed.failure, chunks=(chunk, *inflight))
            chunk.times = [res.times for res in results]
            aborted = [r for r, res in enumerate(results) if res.aborted]
            if aborted:
                return Failure(
                    FailureKind.COLLECTIVE,
                    f"steps {chunk.first + 1}-{chunk.last}: a collective failed on rank(s) {aborted}",
                )
            now = time.monotonic()
            count, seconds, last_done = chunk.last - chunk.first, max(1e-9, now - last_done), now
            size, self.pace = plan.next_size(next_step, count, seconds), (count, seconds)
            records = [
                {
                    "step": chunk.first + k + 1,
                    "epoch": (chunk.first + k) // plan.steps_per_epoch,
                    **m,
                    "samples_per_s": cfg.batch_size * count / seconds,
                    "world_size": group.world,
                    "time": time.time(),
                }
                for k, m in enumerate(results[0].metrics)
            ]
            if chunk.eval is not None:
                try:
                    records[-1].update(self._evaluated(group, chunk.eval))
                except Failed as failed:
                    hooks.completed(chunk, records)  # the steps are done: the survivors' state is past them
                    self.owed = (chunk.last, records[-1], chunk.state is not None)
                    return dataclasses.replace(failed.failure, chunks=tuple(inflight))
            preempted = [r for r, res in enumerate(results) if res.sigterm]
            if preempted:
                stop = keep_first(
                    Failure(
                        FailureKind.PREEMPTED, f"SIGTERM to rank(s) {preempted} (preemption)", ranks=tuple(preempted)
                    )
                )
            stop = keep_first(hooks.completed(chunk, records))
            if chunk.state is not None:
                stop = keep_first(hooks.save(chunk.state, chunk.last))
            if stop is not None and not inflight and chunk.last < plan.total:
                return self._stopped(group, stop, chunk.last, hooks, saved=chunk.state is not None)
        return None

    def _stopped(self, group: Any, stop: Failure, step: int, hooks: Hooks, saved: bool = False) -> Failure:
        """Nothing in flight: a planned stop takes a checkpoint of the step reached (so it loses none)."""
        if stop.kind is not FailureKind.REPLACEMENT_READY and not saved:
            hooks.save(self.snapshot(group, step), step)
        return stop
