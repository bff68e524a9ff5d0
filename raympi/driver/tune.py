"""Ray Tune: a trainable whose trials reserve their workers, and a run that reports to its trial.

``raympi.tune.trainable(train_fn, workers=N)`` gives Tune one placement group per trial, as Ray
Train's ``TorchTrainer`` does: an empty head bundle for the trial's own thread (it only drives) and
one bundle per worker, so Tune reserves exactly what a trial needs and trials queue instead of
failing.  Inside the trial, ``train_fn(config)`` calls :func:`raympi.fit` as anywhere else, and
``fit``:

- places its workers in the trial's bundles (no placement group of its own, no hot spares);
- reports every step's record (evaluations included) to Tune, in step order, each checkpoint with
  the record of its step, so ASHA, PBT and the rest see progress and can stop, pause or clone;
- resumes from the checkpoint Tune hands the trial (PBT's exploit, a paused trial).

A plain function trainable that calls ``fit`` has no room reserved for the workers: ``fit`` fails at
once with an error naming :func:`trainable`, never after a placement timeout.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import math
import sys
from typing import Any, Callable

import ray

from raympi.exceptions import ConfigError

__all__ = ["TrialSlots", "TuneReport", "current", "in_trial", "restore_into", "trainable"]


@dataclasses.dataclass(frozen=True)
class TrialSlots:
    """What a trial reserved for ``fit``'s workers: its placement group, their bundles, one's resources."""

    pg: Any
    bundles: tuple[int, ...]
    bundle: dict[str, float]


_slots: TrialSlots | None = None  # set while a trainable() function runs in this trial's process


def current() -> TrialSlots | None:
    """The trial's worker bundles while a :func:`trainable` runs here, else ``None``."""
    return _slots


def trainable(
    train_fn: Callable[[dict[str, Any]], Any],
    workers: int = 1,
    resources_per_worker: dict[str, float] | None = None,
    use_gpu: bool = False,
    head_resources: dict[str, float] | None = None,
) -> Any:
    """A Tune trainable running ``train_fn(config)``, whose trials reserve ``workers`` workers.

    Args:
        train_fn: the user's function; it calls ``raympi.fit(..., workers=workers)``.
        workers: the workers each trial trains with.
        resources_per_worker: one worker's Ray resources; default ``{"CPU": 1}`` (plus one GPU with ``use_gpu``).
        use_gpu: one GPU per worker.
        head_resources: what the trial's own thread holds; default nothing (it only drives the workers).

    Returns:
        What ``tune.Tuner`` takes: ``tune.with_resources(train_fn, PlacementGroupFactory(...))``.

    Example:
        >>> tuner = tune.Tuner(  # doctest: +SKIP
        ...     raympi.tune.trainable(train_fn, workers=2),
        ...     param_space={"lr": tune.loguniform(1e-4, 1e-1)},
        ...     tune_config=tune.TuneConfig(metric="eval_loss", mode="min", scheduler=ASHAScheduler()),
        ... )
    """
    from ray import tune

    if workers < 1:
        raise ConfigError(f"raympi.tune.trainable: workers must be at least 1, got {workers}")
    bundle = {"CPU": 1.0, **{k: float(v) for k, v in (resources_per_worker or {}).items()}}
    if use_gpu:
        bundle["GPU"] = bundle.get("GPU") or 1.0
    head = {k: float(v) for k, v in (head_resources or {}).items() if v}
    first = 1 if head else 0  # Tune drops an empty head bundle: the workers' bundles then start at 0

    run = functools.wraps(train_fn)(_Trial(train_fn, tuple(range(first, first + workers)), bundle))
    return tune.with_resources(run, tune.PlacementGroupFactory([head, *([bundle] * workers)], strategy="PACK"))


class _Trial:
    """``train_fn`` run with the trial's worker bundles known to ``fit`` (a class: Ray pickles it by
    reference, so the module state it sets is this module's in the trial's process)."""

    def __init__(self, train_fn: Callable[[dict[str, Any]], Any], bundles: tuple[int, ...], bundle: dict[str, float]):
        self.train_fn, self.bundles, self.bundle = train_fn, bundles, bundle

    def __call__(self, config: dict[str, Any]) -> Any:
        global _slots
        _slots = TrialSlots(ray.util.get_current_placement_group(), self.bundles, self.bundle)
        try:
            return self.train_fn(config)
        finally:
            _slots = None


def _in_tune_session() -> bool:
    if "ray.tune" not in sys.modules:  # a Tune trial imported it; nothing else needs to
        return False
    from ray.train._internal.session import get_session

    session = get_session()
    return session is not None and getattr(session, "world_rank", 0) is None


def in_trial(workers: int) -> TrialSlots | None:
    """The trial's worker bundles when ``fit`` runs inside a Tune trial, else ``None``.

    Raises:
        ConfigError: a Tune trial that reserved no room for ``workers`` workers (a plain function
            trainable, or fewer bundles than workers): at once, naming :func:`trainable`.
    """
    slots = current()
    if slots is None and _in_tune_session():
        raise ConfigError(
            f"fit(workers={workers}) runs inside a Ray Tune trial that reserved no resources for its workers "
            "(the trial holds only its own): wrap the function with "
            f"raympi.tune.trainable(train_fn, workers={workers}) so that Tune reserves them with each trial"
        )
    if slots is not None and workers > len(slots.bundles):
        raise ConfigError(
            f"fit(workers={workers}) inside a trial of raympi.tune.trainable(..., workers={len(slots.bundles)}): "
            "pass the same workers to both"
        )
    return slots


def restore_into(root: str) -> bool:
    """Copy the checkpoint Tune hands this trial (PBT's exploit, a paused trial) into ``root`` as its
    step folder, for ``fit`` to resume from; False when Tune has none."""
    from ray import tune

    checkpoint = tune.get_checkpoint()
    if checkpoint is None:
        return False
    with checkpoint.as_directory() as folder:
        with open(os.path.join(folder, "manifest.json")) as f:
            step = int(json.load(f)["step"])
        shutil.copytree(folder, os.path.join(root, f"step-{step:08d}"), dirs_exist_ok=True)
    return True


class TuneReport:
    """A callback that reports the run to its trial: every step's record, in order; a checkpoint
    with the record of its step.

    Every report carries the newest evaluation's ``eval_*`` metrics (NaN before the first one, which
    schedulers skip), since Tune wants a trial's metric in each result.

    A record waits while a checkpoint of its step may still come: those of ``checkpoint_every``
    steps until it is on storage, and the newest (a run's last step is checkpointed too).
    """

    def __init__(self, checkpoint_every: int, eval_names: tuple[str, ...] = ()) -> None:
        self.every = checkpoint_every
        self.waiting: list[dict[str, Any]] = []
        self.checkpoints: dict[int, str] = {}
        self.last: dict[str, Any] = {}
        self.evaluation: dict[str, float] = {name: math.nan for name in eval_names}

    def _report(self, record: dict[str, Any], path: str | None) -> None:
        from ray import tune

        self.evaluation.update({k: v for k, v in record.items() if k.startswith("eval_")})
        metrics = {**self.evaluation, **{k: v for k, v in record.items() if isinstance(v, (int, float, str, bool))}}
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(path) if path else None)
        self.last = record

    def _flush(self, everything: bool) -> None:
        while self.waiting and (everything or len(self.waiting) > 1):
            step = self.waiting[0]["step"]
            if not everything and self.every and step % self.every == 0 and step not in self.checkpoints:
                return
            self._report(self.waiting.pop(0), self.checkpoints.pop(step, None))

    def on_step(self, record: dict[str, Any]) -> None:
        self.waiting.append(record)
        self._flush(everything=False)

    def on_checkpoint(self, path: str, step: int) -> None:
        if any(r["step"] == step for r in self.waiting):
            self.checkpoints[step] = path
            self._flush(everything=False)
        else:  # its record went already (after a restart): the checkpoint still goes, with the newest record
            self._report(self.last, path)

    def on_restart(self, record: dict[str, Any]) -> None:
        self._flush(everything=True)  # a checkpoint still pending may never come

    def on_end(self, records: list[dict[str, Any]]) -> None:
        self._flush(everything=True)
