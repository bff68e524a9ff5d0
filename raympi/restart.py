"""Recovery from failures, for the driver of :mod:`raympi.fit`: warm when the survivors can keep their
state, cold otherwise, and growing back when capacity returns.

:class:`Recovery` is a mixin of fit's run object and works on its state: ``cfg``, ``group`` (the
:class:`~raympi.group.WorkerGroup`), ``history``, ``restarts``, ``memory`` (the newest checkpoint in
driver memory), ``store``, ``sampler``, ``start_step``, ``spe``, ``worker_args``, ``use_gpu``,
``ray_dataset``, ``bundle``, ``checkpoint``, ``expanding`` and ``recovering``.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import ray

from raympi.exceptions import CapacityError, FormationError, RestartsExhaustedError, WorkerLostError
from raympi.group import WorkerGroup, cluster_capacity

__all__ = ["Recovery"]


class _Regroup(Exception):
    """Internal: capacity came back; re-form the group at full size from the checkpoint just taken."""


class _Preempted(Exception):
    """Internal: a worker got SIGTERM (a spot reclaim); re-form without it from the checkpoint just taken."""


class Recovery:
    """Failure handling of one :func:`raympi.fit` run (see the module docstring)."""

    def _recover(self, exc: Exception) -> None:
        """Recover from an infrastructure failure or a planned regroup: warm when the survivors can keep
        their state, else cold (kill the group, re-form it with what the cluster can host, restore the newest checkpoint)."""
        detected = time.monotonic()
        self.expanding = False
        grow = isinstance(exc, (_Regroup, _Preempted))  # planned: a fresh checkpoint is in memory
        failed_step = self.history[-1]["step"] if self.history else self.start_step
        record = {
            "time": time.time(), "step": failed_step, "ranks": getattr(exc, "ranks", []), "nodes": getattr(exc, "nodes", []),
            "cause": str(exc).splitlines()[0] if str(exc) else "capacity returned", "kind": type(exc).__name__.lstrip("_"),
            "path": "cold", "world_before": self.group.world if self.group else 0,
        }
        failures = [r for r in self.restarts if r["kind"] not in ("Regroup", "Preempted", "Grow")]
        if not grow and len(failures) >= self.cfg.max_restarts:
            if self.group is not None:
                self.group.shutdown()
                self.group = None
            self.store.wait(strict=False)
            raise RestartsExhaustedError(
                f"training failed {len(failures) + 1} times, more than max_restarts={self.cfg.max_restarts}; last failure: "
                f"{record['cause']}. The newest checkpoint is {self.checkpoint}: fit(..., resume=True) continues from it"
            ) from exc
        if not grow and self._warm(exc, record, detected):
            return
        if grow:
            self.store.wait()  # the checkpoint to grow from must be fetched before its rank 0 goes
        if self.group is not None:
            self.group.shutdown()
            self.group = None
        self.store.wait(strict=False)  # the newest checkpoint's state is in memory once its write is done
        print(f"raympi: {record['cause']}; restarting from step {self.memory[0] if self.memory else 0}", file=sys.stderr)
        step, state = self.memory if self.memory else (0, None)
        self.group = self._regroup(state)
        self.start_step = step
        self.history = [r for r in self.history if r["step"] <= step]
        record.update(world_after=self.group.world, steps_lost=failed_step - step, restored_step=step)
        self.restarts.append(record)
        self.recovering = (record, detected)

    def _warm(self, exc: Exception, record: dict[str, Any], detected: float) -> bool:
        """Warm restart: the survivors abandon the step in flight, keep their state, and re-form with
        replacements; nothing but that step is lost. False when it cannot apply (then a cold restart follows)."""
        group, failed = self.group, sorted(set(getattr(exc, "ranks", [])))
        if group is None or self.sampler.sharded or not failed or len(failed) >= group.world:
            record["warm_skipped"] = "no survivors known" if group is not None and not self.sampler.sharded else "not possible"
            return False
        survivors = [r for r in range(group.world) if r not in failed]
        for r in survivors:
            group.actors[r].abort.remote()
        group.replace(failed)  # replacements boot while the survivors drain
        deadline = time.monotonic() + self.cfg.step_timeout_s
        reported: dict[int, dict[str, Any]] = {}
        done = {r: self.history[-1]["step"] if self.history else self.start_step for r in survivors}
        for chunk in getattr(exc, "chunks", []):
            refs = {r: chunk["refs"][r] for r in survivors}
            ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
            if len(ready) < len(refs):
                record["warm_skipped"] = f"a survivor did not stop within step_timeout_s={self.cfg.step_timeout_s:g} s"
                return False
            for r, ref in refs.items():
                try:
                    res = ray.get(ref)
                except ray.exceptions.RayActorError:  # lost as well (several ranks on one lost node)
                    failed.append(r)
                    group.replace([r])
                    continue
                except ray.exceptions.RayError as error:
                    record["warm_skipped"] = f"a survivor failed: {type(error).__name__}"
                    return False
                done[r] = res["step"]
                for k, metrics in enumerate(res["metrics"]):
                    reported[chunk["first"] + k + 1] = metrics
            survivors = [r for r in survivors if r not in failed]
            if not survivors:
                record["warm_skipped"] = "no survivor left"
                return False
        root = max(survivors, key=lambda r: done[r])
        step = done[root]
        world_before = group.world
        print(f"raympi: {record['cause']}; warm restart of {len(survivors)} survivor(s) at step {step}", file=sys.stderr)
        try:
            group.reform(survivors, root, time.monotonic() + self.cfg.restart_timeout_s)
        except Exception as warm_error:  # whatever went wrong, the cold path starts from scratch
            record["warm_error"] = f"{type(warm_error).__name__}: {warm_error}"
            return False
        last = self.history[-1]["step"] if self.history else self.start_step
        self.history = [r for r in self.history if r["step"] <= step]
        for s in range(last + 1, step + 1):  # steps the survivors finished but the driver had not seen yet
            self.history.append({"step": s, "epoch": (s - 1) // self.spe, **reported.get(s, {}), "world_size": world_before, "time": time.time()})
        self.start_step = step
        record.update(path="warm", world_after=group.world, steps_lost=max(0, record["step"] - step), restored_step=step)
        self.restarts.append(record)
        self.recovering = (record, detected)
        return True

    def _regroup(self, state: dict[str, Any] | None) -> WorkerGroup:
        """As many workers as the cluster can host, from min_workers to workers, waiting up to restart_timeout_s."""
        cfg = self.cfg
        deadline = time.monotonic() + cfg.restart_timeout_s
        last_error: Exception | None = None
        cap = cfg.workers
        while True:
            world = min(cap, cluster_capacity(self.bundle))
            remaining = deadline - time.monotonic()
            if world >= cfg.min_workers:
                try:
                    return WorkerGroup(cfg, world, self.worker_args, state, self.use_gpu, self.ray_dataset, place_timeout_s=min(5.0, max(1.0, remaining)))
                except (CapacityError, WorkerLostError, FormationError) as exc:  # a node went away meanwhile: count again
                    last_error = exc
                    # Ray may still count a cut-off node as alive: ask for one worker fewer next time
                    # (a later checkpoint grows the group back once the capacity is real).
                    cap = max(cfg.min_workers, world - 1)
            if remaining <= 0:
                why = (f"the cluster can host {world} worker(s) of {self.bundle}, fewer than min_workers={cfg.min_workers}"
                       if world < cfg.min_workers else f"re-forming {world} worker(s) kept failing (last: {last_error})")
                raise CapacityError(
                    f"after the failure {why}, and no way forward was found within restart_timeout_s={cfg.restart_timeout_s:g} s. "
                    f"The newest checkpoint is {self.checkpoint}: fit(..., resume=True) continues from it"
                )
            time.sleep(min(1.0, max(0.05, remaining)))

    def _expand(self, step: int) -> None:
        """Take the replacements that are ready into the group (warm: rank 0's state by broadcast)."""
        self.expanding = False
        before, start = self.group.world, time.monotonic()
        record = {"time": time.time(), "step": step, "ranks": [], "nodes": [], "cause": "replacement ready", "kind": "Grow",
                  "path": "warm", "world_before": before, "restored_step": step, "steps_lost": 0}
        try:
            self.group.reform(list(range(before)), 0, time.monotonic() + self.cfg.restart_timeout_s)
        except Exception as exc:  # a failed expansion is a failure like any other
            raise WorkerLostError(f"taking in a replacement at step {step} failed: {type(exc).__name__}: {exc}") from None
        record.update(world_after=self.group.world, recovery_s=time.monotonic() - start)
        self.restarts.append(record)
