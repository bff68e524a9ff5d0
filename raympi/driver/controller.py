"""The controller: one ``fit()`` run as a small state machine.

Phases: STARTING (a group is placed and joined) -> RUNNING (the :class:`~raympi.driver.pipeline.Pipeline`
runs chunks) -> DONE; or, when the pipeline returns a :class:`~raympi.driver.policy.Failure`,
RECOVERING: the pure :func:`~raympi.driver.policy.decide` picks Warm, Cold, Grow, Finish or Raise and
:mod:`raympi.driver.recovery` carries it out, then RUNNING again (or FAILED).  The controller owns
the one :class:`~raympi.driver.run_state.RunState` and replaces it at each transition; it decides
nothing itself, it only routes between the pipeline, the policy and the recovery actions.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from typing import Any, Callable

from raympi.driver import drains, recovery
from raympi.driver.checkpoint import CheckpointStore
from raympi.driver.config import FitConfig
from raympi.driver.capacity import cluster_capacity, worker_bundle
from raympi.driver.group import WorkerGroup
from raympi.driver.pipeline import Chunk, ChunkPlan, Pipeline
from raympi.driver.callbacks import Dispatcher, run_params
from raympi.driver.policy import Capacity, Decision, Failed, Failure, FailureKind, Finish, Grow, Raise, Warm, decide
from raympi.driver.report import MetricsLog, Progress, RankLog, read_ranks, write_plot
from raympi.driver.run_state import Checkpoint, Phase, RunState, StepRecord, Timers
from raympi.driver.stragglers import StragglerRule, StragglerWatch, peer_medians
from raympi.driver.timeline import write_timeline
from raympi.exceptions import FormationError
from raympi.worker import WorkerSpec

__all__ = ["Controller"]

log = logging.getLogger("raympi")

DRAIN_POLL_S = 0.5  # how often the driver asks Ray which nodes are being drained (a call of about 1 ms)


class Controller:
    """Runs one ``fit()`` to the end: see the module docstring.

    Args:
        cfg: the options.
        spec: what every worker is built from.
        pipeline: the chunk pipeline (its plan says how many steps in all).
        store: where checkpoints go.
        run: the starting state (a resumed run's history and checkpoint, or empty).
        ray_dataset: a ``ray.data.Dataset`` and its columns (split per group), else ``None``.
        announce: says what a slow start is doing, a line at a time.
        fingerprint: what a checkpoint's step means (global batch, seed, dataset length, parameter
            shapes), written into every manifest so that a resume can check it.
        new_group: builds a worker group ``(cfg, world, spec, state, ray_dataset, place_timeout_s=,
            announce=, spares=)`` for the controller to start; :class:`WorkerGroup` (tests pass a fake one).
        capacity: how many workers of a bundle the cluster could host (:func:`cluster_capacity`).
    """

    def __init__(
        self,
        cfg: FitConfig,
        spec: WorkerSpec,
        pipeline: Pipeline,
        store: CheckpointStore,
        run: RunState,
        ray_dataset: Any = None,
        announce: Callable[[str], None] = lambda text: None,
        fingerprint: dict[str, Any] | None = None,
        new_group: Callable[..., Any] = WorkerGroup,
        capacity: Callable[[dict[str, float]], int] = cluster_capacity,
    ) -> None:
        self.cfg, self.spec, self.pipeline, self.store = cfg, spec, pipeline, store
        now = time.monotonic()
        self.run = dataclasses.replace(run, timers=Timers(progress=now, reformed=now))
        self.plan: ChunkPlan = pipeline.plan
        self.ray_dataset = ray_dataset
        self.announce = announce
        self.fingerprint = fingerprint or {}
        self.make_group, self.capacity = new_group, capacity
        self.group: WorkerGroup | None = None
        self.spare_target: int | None = None  # hot spares every group keeps (:meth:`_spares`)
        # Why the driver was asked to stop (SIGTERM, Ctrl-C): written by the signal handler, which may
        # run between any two lines of the main thread, so it is a mailbox apart from the run state.
        self.signal: str | None = None
        self.callbacks = Dispatcher(cfg.callbacks)
        # metrics.jsonl next to the checkpoints, appended (never rewritten) at checkpoints and at the end
        self.metrics_log = MetricsLog(store.file("metrics.jsonl"), store.fs, written=run.step)
        self.rank_log = RankLog(store.file("ranks.jsonl"), store.fs)
        rule = StragglerRule(cfg.straggler_factor or 0.0, cfg.straggler_chunks)
        self.stragglers = StragglerWatch(rule) if cfg.straggler_factor else None
        self.data_slow_told: set[int] = set()  # ranks already reported slow for their data
        self.next_drain_poll = 0.0  # (time.monotonic) when to ask again which nodes are being drained

    # -- the state machine ------------------------------------------------------------------------

    def fit(self) -> RunState:
        """Train to the end; returns the final run state (its ``newest`` checkpoint holds the final state)."""
        self.progress = Progress(self.plan.total, self.cfg.progress)
        previous = _on_signals(self._on_signal)
        try:
            self.callbacks.start(run_params(self.cfg, self.fingerprint.get("params", {})))
            failure: Failure | None = None
            while True:
                if failure is None and self.group is None:
                    failure = self._start()
                if failure is None:
                    self._enter(Phase.RUNNING)
                    failure = self.pipeline.run(self.group, self.run.step, self, self._stop_requested)
                    self.store.abandon_unsaved()  # checkpoints asked for in chunks that never completed
                if failure is None:
                    finished = self._finish()
                    self._drop_group(park=self.cfg.keep_workers)
                    return finished
                # (a stop asked for by the user or a callback is no failure to recover from: not announced as one)
                self._enter(
                    Phase.RECOVERING, announce=failure.kind not in (FailureKind.DRIVER_SIGTERM, FailureKind.EARLY_STOP)
                )
                failure = self._keep_report(failure)
                decision = self._decide(failure)
                if isinstance(decision, Finish):
                    return self._finish()
                failure = self._carry_out(decision, failure)
        except BaseException as error:
            self._enter(Phase.FAILED)
            self.callbacks.error(error)
            raise
        finally:
            _restore_signals(previous)
            self.progress.close()
            self._drop_group()

    def _enter(self, phase: Phase, announce: bool = True) -> None:
        if self.run.phase is not phase:
            log.info("raympi: %s -> %s at step %d", self.run.phase.value, phase.value, self.run.step)
            if announce and phase in (Phase.DRAINING, Phase.RECOVERING):
                self.announce(f"{phase.value} at step {self.run.step}")
            self.run = dataclasses.replace(self.run, phase=phase)

    def _start(self) -> Failure | None:
        """STARTING: place and join a full group from the newest checkpoint (or the model)."""
        self._enter(Phase.STARTING)
        try:
            self.group = self._new_group(self.cfg.workers, self.run.newest and self.run.newest.state)
            self._time(progress=time.monotonic())
            self.announce(f"training from step {self.run.step} (the first step also warms up autograd and MPI)")
        except Failed as failed:
            return dataclasses.replace(failed.failure, phase=Phase.STARTING)
        except FormationError as error:
            return Failure(FailureKind.FORMATION, str(error).splitlines()[0], phase=Phase.STARTING)
        return None

    def _time(self, **changes: Any) -> None:
        self.run = dataclasses.replace(self.run, timers=dataclasses.replace(self.run.timers, **changes))

    def _new_group(self, world: int, state: Any, place_timeout_s: float | None = None) -> WorkerGroup:
        group: WorkerGroup = self.make_group(
            self.cfg,
            world,
            self.spec,
            state,
            self.ray_dataset,
            place_timeout_s=place_timeout_s,
            announce=self.announce,
            spares=self._spares(world),
        )
        return group.start()

    def _spares(self, world: int) -> int:
        """Hot spares: as configured, else one when the cluster has room beyond the workers (none for Ray Data).

        Decided when the run starts and kept by every later group: a cold restart often counts while the
        dead workers' resources are not yet released or a lost node is not yet back, and the group starts
        its spare once there is room (``WorkerGroup`` tops the target up)."""
        if self.spare_target is None:
            if self.ray_dataset is not None:
                self.spare_target = 0
            elif self.cfg.spares is not None:
                self.spare_target = self.cfg.spares
            else:
                self.spare_target = 1 if self.capacity(self._bundle()) > world else 0
        return self.spare_target

    def _keep_report(self, failure: Failure) -> Failure:
        """A hang's report (each rank's place and stacks) goes to a file in the run's folder; the failure then
        names that file, in its cause and its report."""
        if not failure.report or failure.report.startswith(self.store.file("")):
            return failure
        path = self.store.file(f"hang-step-{self.run.step + 1}-{time.strftime('%Y%m%d-%H%M%S')}.txt")
        try:
            with self.store.fs.open(path, "w") as f:
                f.write(failure.cause + "\n\n" + failure.report + "\n")
        except OSError as exc:
            log.warning("raympi: the hang report could not be written to %s: %s", path, exc)
            return failure
        return dataclasses.replace(failure, cause=f"{failure.cause}; every rank's stack: {path}", report=path)

    def _decide(self, failure: Failure) -> Decision:
        """RECOVERING: what the policy says about ``failure``."""
        if not failure.followup:  # (a follow-up's failure was noticed when the first one was)
            self._time(detected=time.monotonic())
        self._collect(wait=failure.kind.planned)  # a planned stop's checkpoint must be on disk (and known) first
        capacity = Capacity(world=self.group.world if self.group else 0, cluster=self.capacity(self._bundle()))
        decision = decide(failure, self.run, self.cfg, capacity)
        log.info("raympi: %s -> %s", failure.kind.value, type(decision).__name__)
        return decision

    def _carry_out(self, decision: Decision, failure: Failure) -> Failure | None:
        """Carry a Raise, Grow, Warm or Cold out; returns a follow-up failure for the policy, if any."""
        detected, restarts = self.run.timers.detected, len(self.run.restarts)
        spares_used = self.group.spares.used if self.group else 0
        try:
            followup = self._apply(decision, failure)
        finally:
            now = time.monotonic()
            new = [
                dataclasses.replace(
                    r,
                    detect_s=detected - self.run.timers.progress,
                    reform_s=now - detected,
                    spare=bool(self.group and self.group.spares.used > spares_used and r.path == "warm"),
                )
                for r in self.run.restarts[restarts:]
            ]
            self.run = dataclasses.replace(self.run, restarts=(*self.run.restarts[:restarts], *new))
            self._time(reformed=now, recovering=detected if new else self.run.timers.recovering)
            self.metrics_log.rewind(self.run.step)  # a cold restart goes back: the redone steps are logged again
            if self.stragglers is not None:  # the ranks are numbered anew: no streak carries over
                self.stragglers.reset()
            for record in new:
                self.callbacks.restart(record.as_dict())
        return followup

    def _apply(self, decision: Decision, failure: Failure) -> Failure | None:
        if isinstance(decision, Raise):
            self._drop_group()
            self.store.wait(strict=False)
            raise decision.error
        if isinstance(decision, Grow):
            try:
                self.run = recovery.grow(self._running(), failure, self.run, self.cfg)
            except recovery.INFRASTRUCTURE_ERRORS as error:  # a failed expansion is a failure like any other
                return Failure(
                    FailureKind.WORKER_LOST,
                    f"taking in a replacement at step {self.run.step} failed: {type(error).__name__}: {error}",
                    phase=Phase.RECOVERING,
                )
            return None
        world = failure.world_before or (self.group.world if self.group else 0)
        if isinstance(decision, Warm):
            try:
                self.run = recovery.warm(
                    self._running(), decision, failure, self.run, self.cfg, self.plan.steps_per_epoch
                )
            except recovery.WarmSkipped as skipped:
                return skipped.followup(failure, world)  # the policy decides again (a cold restart)
            self.run = dataclasses.replace(self.run, pace=self.run.pace.restarted())
            return None
        self._drop_group()  # Cold
        self.store.wait(strict=False)  # the newest checkpoint's state is in memory once its write is done
        self._collect()
        try:
            self.group, self.run = recovery.cold(
                self._new_group, self.capacity, self._bundle(), failure, self.run, self.cfg, world
            )
        except recovery.NoCapacity as none:
            return none.followup(failure)
        except Failed as failed:  # the user's code failed in the new group
            return dataclasses.replace(failed.failure, phase=Phase.RECOVERING)
        return None

    def _finish(self) -> RunState:
        self._relabel(wait=True)
        self.store.wait()
        self._collect()
        self._write_reports(plot=True)
        self._enter(Phase.DONE)
        self.callbacks.end(list(self.run.history))
        return self.run

    # -- hooks the pipeline calls -----------------------------------------------------------------

    def completed(self, chunk: Chunk, records: list[StepRecord]) -> Failure | None:
        """Steps done: record them, report progress; a ready replacement asks to drain and grow."""
        run, now = self.run, time.monotonic()
        restarts, timers = run.restarts, run.timers
        if timers.recovering is not None and restarts:
            # failure noticed -> first step completed after it, and re-formed -> that step
            restarts = (
                *restarts[:-1],
                dataclasses.replace(
                    restarts[-1], recovery_s=now - timers.recovering, first_step_s=now - timers.reformed
                ),
            )
        pace, slower = run.pace.observe(records[-1]["samples_per_s"], now)
        self.run = dataclasses.replace(
            run,
            history=run.history.until(records[0]["step"] - 1).append(records),  # an owed evaluation: its step again
            step=records[-1]["step"],
            restarts=restarts,
            timers=dataclasses.replace(timers, progress=now, recovering=None),
            pace=pace,
        )
        self._collect()
        self._relabel()
        if chunk.times:
            self.callbacks.ranks(self.rank_log.append(chunk, self._running().world))
        self.progress.update(chunk.last, records[-1], force=chunk.eval is not None or chunk.last == self.plan.total)
        if self.callbacks.steps(records) and chunk.last < self.plan.total:
            return Failure(
                FailureKind.EARLY_STOP, f"stopped by a callback after step {chunk.last}", phase=Phase.DRAINING
            )
        if self._running().replacement_ready() and chunk.last < self.plan.total:
            return Failure(FailureKind.REPLACEMENT_READY, "replacement ready", phase=Phase.DRAINING)
        if slower and chunk.last < self.plan.total:
            return Failure(
                FailureKind.DEGRADED,
                f"steps ran {slower:.0f}x slower after the warm restart than before it",
                phase=Phase.DRAINING,
            )
        # (a chunk that completes while draining for a planned stop ran on the group about to change)
        return self._straggler(chunk) if chunk.last < self.plan.total and self.run.phase is Phase.RUNNING else None

    def _straggler(self, chunk: Chunk) -> Failure | None:
        """A rank slow in its own compute for ``straggler_chunks`` chunks in a row, with a hot spare off its node
        to take its place: a planned stop to evict it (:mod:`raympi.driver.stragglers`)."""
        if self.stragglers is None or not chunk.times:
            return None
        steps = chunk.last - chunk.first
        slow, data_slow = self.stragglers.observe(chunk.times, steps)
        group = self._running()
        for r in sorted(set(data_slow) - self.data_slow_told):
            self.data_slow_told.add(r)
            log.warning(
                "raympi: rank %d waits %.0f ms a step for its data, far longer than its peers: its data is slow "
                "(a new process would read it the same way: it is not evicted)",
                r,
                1e3 * chunk.times[r].data_s / steps,
            )
        if not slow:
            return None
        nodes = tuple(group.nodes[r] for r in slow if r < len(group.nodes))
        compute = [t.compute_s for t in chunk.times]
        peers = peer_medians(compute)
        ratio = min(compute[r] / max(peers[r], 1e-9) for r in slow)
        cause = (
            f"rank(s) {slow} computed {ratio:.1f}x slower than the median of their peers for "
            f"{self.cfg.straggler_chunks} chunks in a row (straggler_factor={self.cfg.straggler_factor:g})"
        )
        if not group.spare_off(set(nodes)):
            if self.stragglers.streak.get(slow[0]) == self.cfg.straggler_chunks:  # said once a streak
                log.warning("raympi: %s; no hot spare off their node(s) to take their place: going on", cause)
            return None
        self.stragglers.reset()
        return Failure(FailureKind.STRAGGLER, cause, ranks=tuple(slow), nodes=nodes, phase=Phase.DRAINING)

    def draining(self, stop: Failure) -> None:
        """The pipeline stops sending chunks: a planned stop is coming."""
        self._enter(Phase.DRAINING)

    def save(self, state_ref: Any, step: int) -> Failure | None:
        """Write rank 0's state as a checkpoint in the background; room for more workers asks to drain and regroup."""
        epoch, in_epoch = divmod(step, self.plan.steps_per_epoch)
        # The cursor and the last record, not the history: that is metrics.jsonl's (appended just now).
        manifest = {
            "step": step,
            "epoch": epoch,
            "cursor": {"epoch": epoch, "step_in_epoch": in_epoch},
            "world_size": self._running().world,
            "metrics": self.run.history.last or {},
            "config": _plain_config(self.cfg),
            "run": self.fingerprint,
            "restarts": [r.as_dict() for r in self.run.restarts],
            "saved_at": time.time(),
        }
        self.store.save_async(state_ref, manifest)
        self._write_reports()
        group = self._running()
        if (
            step < self.plan.total
            and group.world < self.cfg.workers
            and not group.spares.replacements
            and self.capacity(self._bundle()) > group.world
        ):
            return Failure(FailureKind.CAPACITY_BACK, "capacity returned", phase=Phase.DRAINING)
        return None

    # -- helpers ----------------------------------------------------------------------------------

    def _stop_requested(self) -> Failure | None:
        if self.signal is not None:
            return Failure(FailureKind.DRIVER_SIGTERM, self.signal, phase=Phase.DRAINING)
        return self._drained()

    def _drained(self) -> Failure | None:
        """Ranks on a node being drained (a preemption notice, :mod:`raympi.driver.drains`): a planned stop that
        moves them to hot spares elsewhere before the node's deadline.  Spares alone on such a node are dropped."""
        now = time.monotonic()
        if self.group is None or now < self.next_drain_poll:
            return None
        self.next_drain_poll = now + DRAIN_POLL_S
        draining = drains.draining_nodes()
        group = self.group
        new = frozenset(draining) - group.draining
        group.draining = frozenset(draining)
        ranks = tuple(r for r, node in enumerate(group.nodes) if node in draining)
        if not ranks:
            if new:
                group.drop_spares_on(new)
            return None
        nodes = tuple(group.nodes[r] for r in ranks)
        deadlines = [d for n in set(nodes) if (d := draining[n]) is not None]
        within = f"within {min(deadlines) - time.time():.0f} s" if deadlines else "with no deadline"
        names = ", ".join(sorted({n[:8] for n in nodes}))
        cause = f"rank(s) {list(ranks)} on node(s) being drained ({names}, gone {within})"
        return Failure(FailureKind.NODE_DRAIN, cause, ranks=ranks, nodes=nodes, phase=Phase.DRAINING)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.signal is not None:
            raise KeyboardInterrupt  # a second Ctrl-C: stop at once
        if signum == signal.SIGINT:
            self.announce("interrupted: finishing the steps in flight and writing a checkpoint (Ctrl-C again to abort)")
        self.signal = "stopped by SIGTERM" if signum == signal.SIGTERM else "interrupted (Ctrl-C)"

    def _collect(self, wait: bool = False) -> None:
        """Take in the checkpoints the writer thread finished (it hands them over through a queue)."""
        if wait:
            self.store.wait()
        for path, step, state in self.store.drain_saved():
            if self.run.newest is None or step >= self.run.newest.step:
                self.run = dataclasses.replace(self.run, newest=Checkpoint(step, path, state))
            self.callbacks.checkpoint(path, step)

    def _relabel(self, wait: bool = False) -> None:
        """Label the restarts acted on as soon as a rank fell silent, now that Ray has said (or, within
        ``DEATH_NOTICE_S``, not said) whether its process died: lost, or hung (``wait``: for every label)."""
        labels = self.group.label_silent(wait) if self.group is not None else []
        restarts = list(self.run.restarts)
        for rank, died in labels:
            at = [i for i, r in enumerate(restarts) if r.kind == FailureKind.HUNG.value and rank in r.ranks]
            if not at:
                continue
            record = restarts[at[-1]]
            how = "its process had died" if died else "its process was alive but silent (stopped or hung)"
            kind = FailureKind.WORKER_LOST if died else FailureKind.HUNG
            restarts[at[-1]] = dataclasses.replace(record, kind=kind.value, cause=f"{record.cause}; rank {rank}: {how}")
            log.info("raympi: the rank %d replaced at step %d: %s", rank, record.step, how)
        if labels:
            self.run = dataclasses.replace(self.run, restarts=tuple(restarts))

    def _running(self) -> WorkerGroup:
        """The group running now (there is one from a successful start to the next drop)."""
        assert self.group is not None, "no worker group"
        return self.group

    def _bundle(self) -> dict[str, float]:
        return worker_bundle(self.cfg, self.spec.device == "cuda")

    def _drop_group(self, park: bool = False) -> None:
        if self.group is not None:
            self.group.shutdown(park=park)
            self.group = None

    def _write_reports(self, plot: bool = False) -> None:
        """Append the steps not yet in metrics.jsonl; at the end, the plot and each rank's timeline too (they read
        the whole history)."""
        self.metrics_log.append(self.run.history)
        if plot:
            fs = self.store.fs
            write_plot(list(self.run.history), self.store.file("metrics.png"), fs)
            lines = read_ranks(self.store.file("ranks.jsonl"), fs)
            write_timeline(lines, [r.as_dict() for r in self.run.restarts], self.store.file("timeline.png"), fs)


def _on_signals(handler: Any) -> dict[int, Any]:
    """Handle SIGTERM and SIGINT (Ctrl-C) when we may (main thread); returns the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}


def _restore_signals(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _plain_config(cfg: FitConfig) -> dict[str, Any]:
    out = {}
    for name in type(cfg).model_fields:
        value = getattr(cfg, name)
        out[name] = value if isinstance(value, (int, float, str, bool, type(None), dict)) else repr(value)
    out["mpi"] = cfg.mpi.model_dump()
    return out
