"""Layer 4: ``raympi.fit``, the driver.

The driver validates the options, ships the dataset once, places and joins the
workers, then feeds them chunks of steps (sample indices only) while keeping two
chunks in flight, so the workers never wait for it and it still reports every
half second or so.  It owns the data order and the cursor, takes checkpoints
from rank 0 and writes them in the background.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from collections import deque
from typing import Any

import ray
import torch
import torch.nn.functional as F

from raympi import _tree, data, optim
from raympi._state import TrainState
from raympi._step import make_train_step
from raympi.checkpoint import CheckpointStore
from raympi.config import FitConfig, parse_config
from raympi.exceptions import ConfigError, FormationError, PreemptedError, StepTimeoutError, TrainingError, WorkerLostError
from raympi.group import WorkerGroup, cluster_capacity, worker_bundle
from raympi.report import Progress, write_jsonl, write_plot
from raympi.restart import Recovery, _Preempted, _Regroup

__all__ = ["fit", "Result"]

CHUNK_SECONDS = 0.5  # target duration of one chunk of steps
MAX_CHUNK = 512


@dataclasses.dataclass
class Result:
    """What :func:`fit` returns.

    Attributes:
        state: the final :class:`~raympi.TrainState` (CPU tensors).
        model: the user's module with the trained weights loaded.
        metrics: one record per step (step, epoch, loss, accuracy, samples_per_s,
            world_size, time) plus eval metrics where they were taken.
        checkpoint: the folder of the last checkpoint written.
        restarts: one record per recovered failure (empty when none happened).
    """

    state: TrainState
    model: torch.nn.Module
    metrics: list[dict[str, Any]]
    checkpoint: str | None
    restarts: list[dict[str, Any]]


def fit(model: torch.nn.Module, dataset: Any, workers: int = 1, **options: Any) -> Result:
    """Train ``model`` on ``dataset`` data-parallel over ``workers`` Ray actors joined by MPI.

    Args:
        model: the ``nn.Module`` to train; it is copied to every worker and receives the trained weights.
        dataset: a map-style ``torch.utils.data.Dataset`` of ``(input, target)`` pairs, or an
            ``(inputs, targets)`` tuple of tensors or arrays.
        workers: the number of ranks.
        **options: see :class:`raympi.config.FitConfig` and the README's table.

    Returns:
        A :class:`Result`.

    Raises:
        ConfigError: a bad option or dataset, before any actor starts.
        CapacityError: the cluster cannot host the workers within ``startup_timeout_s``.
        TrainingError: the model, loss or data failed on a worker (with its traceback).

    Example:
        >>> result = raympi.fit(Net(), (images, labels), workers=2, epochs=1, batch_size=64)  # doctest: +SKIP
        >>> result.metrics[-1]["loss"]  # doctest: +SKIP
    """
    cfg = parse_config(workers=workers, **options)
    optimizer = cfg.optimizer or optim.adam(1e-3)
    loss_fn = cfg.loss_fn or F.cross_entropy
    started_ray = False
    if _is_ray_dataset(dataset):
        started_ray = _connect_ray(cfg)  # a Ray Dataset needs Ray to be read
        columns = data.columns_of(dataset, cfg.columns)
        train: Any = (dataset, columns)
        num_samples = dataset.count()
        sample = data.to_tensors(dataset.limit(2), columns)
    else:
        train = data.as_tensors(dataset)
        num_samples, sample = len(train[0]), train
    if num_samples == 0:
        raise ConfigError("dataset is empty: it has no samples to train on")
    eval_data = data.as_tensors(cfg.eval_dataset, "eval_dataset") if cfg.eval_dataset is not None else None
    sampler = data.Sampler(cfg.seed, cfg.batch_size, num_samples, cfg.workers, sharded=_is_ray_dataset(dataset))
    _dry_run(model, loss_fn, optimizer, *sample, cfg)
    root = cfg.checkpoint_dir or os.path.join("runs", "raympi-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    store = CheckpointStore(root, cfg.keep_checkpoints)
    started_ray = _connect_ray(cfg) or started_ray
    try:
        return _Run(cfg, model, loss_fn, optimizer, train, eval_data, sampler, store).run()
    finally:
        store.close()
        if started_ray:
            ray.shutdown()


def _is_ray_dataset(dataset: Any) -> bool:
    return type(dataset).__module__.startswith("ray.data") and hasattr(dataset, "split")


def _dry_run(model, loss_fn, optimizer, inputs, targets, cfg: FitConfig) -> None:
    """One step on two samples in the driver: a data/model mismatch is caught before any actor starts."""
    step = make_train_step(model, loss_fn, optimizer)
    try:
        step(TrainState.create(model, optimizer, seed=cfg.seed), (inputs[:2], targets[:2]))
    except TrainingError:
        raise
    except Exception as exc:
        raise TrainingError(
            f"the dataset's items do not fit the model or the loss: a step on two samples (inputs of shape "
            f"{tuple(inputs[:2].shape)} {inputs.dtype}, targets {tuple(targets[:2].shape)} {targets.dtype}) "
            f"raised {type(exc).__name__}: {exc}"
        ) from exc


def _connect_ray(cfg: FitConfig) -> bool:
    """Join the configured cluster, or start a private local instance; True when we started it."""
    if ray.is_initialized():
        return False
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        ray.init(address=address, logging_level="ERROR")
        return False
    ray.init(address="local", include_dashboard=False, logging_level="ERROR")
    return True


def _on_sigterm(handler: Any) -> Any:
    """Install a SIGTERM handler when we may (main thread); return the previous one."""
    import signal
    import threading

    if handler is None or threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, handler)


class _Run(Recovery):
    """One call of :func:`fit`: the data cursor, the chunk pipeline, checkpoints and metrics (restarts: :class:`Recovery`)."""

    def __init__(self, cfg, model, loss_fn, optimizer, train_data, eval_data, sampler: data.Sampler, store) -> None:
        self.cfg, self.model, self.store = cfg, model, store
        self.sampler = sampler
        self.spe = sampler.steps_per_epoch
        self.total = min(self.spe * cfg.epochs, cfg.max_steps or self.spe * cfg.epochs)
        self.history: list[dict[str, Any]] = []
        self.restarts: list[dict[str, Any]] = []
        self.checkpoint: str | None = None
        self.memory: tuple[int, dict[str, Any]] | None = None  # the newest checkpoint's state, in driver memory
        self.eval_size = len(eval_data[0]) if eval_data is not None else 0
        self.start_step = 0
        if cfg.resume:
            found = store.latest()
            if found is not None:
                self.checkpoint, manifest, state = found
                self.start_step = int(manifest["step"])
                self.memory = (self.start_step, state)
                self.history = [r for r in manifest.get("history", []) if r["step"] <= self.start_step]
        # Shipped once through the object store; a Ray Dataset is split per group by Ray Data instead.
        self.ray_dataset = train_data if sampler.sharded else None
        refs = (None, None) if sampler.sharded else tuple(ray.put(x.numpy() if x.dtype != torch.bfloat16 else x) for x in train_data)
        eval_refs = tuple(ray.put(x.numpy() if x.dtype != torch.bfloat16 else x) for x in eval_data) if eval_data else (None, None)
        self.use_gpu = cfg.use_gpu if cfg.use_gpu is not None else ray.cluster_resources().get("GPU", 0) >= 1
        self.bundle = worker_bundle(cfg, self.use_gpu)
        self.worker_args = (model, loss_fn, optimizer, *refs, *eval_refs)
        self.group: WorkerGroup | None = None
        self.recovering: tuple[dict[str, Any], float] | None = None

    def run(self) -> Result:
        self.progress = Progress(self.total, self.cfg.progress)
        self.sigterm, self.preempted, self.expanding = False, [], False
        previous = _on_sigterm(lambda *_: setattr(self, "sigterm", True))
        try:
            while True:
                try:
                    if self.group is None:
                        self.group = WorkerGroup(self.cfg, self.cfg.workers, self.worker_args, self.memory and self.memory[1], self.use_gpu, self.ray_dataset)
                    return self._loop()
                except (WorkerLostError, StepTimeoutError, FormationError, _Regroup, _Preempted) as exc:
                    self._recover(exc)
                    self.preempted = []
        finally:
            _on_sigterm(previous)
            self.progress.close()
            if self.group is not None:
                self.group.shutdown()

    def _boundary(self, step: int) -> int:
        """The first step after ``step`` at which something must happen (epoch end, eval, checkpoint, end)."""
        ends = [self.total, (step // self.spe + 1) * self.spe]
        for every in (self.cfg.checkpoint_every, self.cfg.eval_every if self.eval_size else 0):
            if every:
                ends.append((step // every + 1) * every)
        return min(ends)

    def _wants_eval(self, step: int) -> bool:
        if not self.eval_size:
            return False
        every = self.cfg.eval_every
        return step % every == 0 if every else step % self.spe == 0 or step == self.total

    def _submit(self, first: int, count: int) -> dict[str, Any]:
        world = self.group.world
        shards: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for s in range(first, first + count):
            for rank, part in enumerate(self.sampler.shards(s, world)):
                shards[rank].append(part)
        actors = self.group.actors
        last = first + count
        chunk = {"first": first, "last": last, "refs": [a.run.remote(shards[r], self.cfg.batch_size) for r, a in enumerate(actors)]}
        if self._wants_eval(last):
            parts = torch.tensor_split(torch.arange(self.eval_size), world)
            chunk["eval"] = [a.evaluate.remote(parts[r]) for r, a in enumerate(actors)]
        if last == self.total or (self.cfg.checkpoint_every and last % self.cfg.checkpoint_every == 0):
            chunk["state"] = actors[0].state_dict.remote()
        return chunk

    def _loop(self) -> Result:
        cfg = self.cfg
        inflight: deque[dict[str, Any]] = deque()
        next_step, chunk_size, last_done = self.start_step, 1, time.monotonic()
        while next_step < self.total or inflight:
            while len(inflight) < 2 and next_step < self.total and not (self.preempted or self.sigterm or self.expanding):
                count = min(chunk_size, self._boundary(next_step) - next_step)
                inflight.append(self._submit(next_step, count))
                next_step += count
            chunk = inflight.popleft()
            # The first step of a new group also warms up autograd and MPI's connections: startup time.
            field = "startup_timeout_s" if chunk["first"] == self.start_step else "step_timeout_s"
            deadline = max(last_done, time.monotonic()) + getattr(cfg, field)
            try:
                results = self.group.gather(chunk["refs"], deadline, f"steps {chunk['first'] + 1}-{chunk['last']}", field)
            except (WorkerLostError, StepTimeoutError) as exc:
                exc.chunks = [chunk, *inflight]  # type: ignore[attr-defined]  # what the survivors may still report
                raise
            if any(res["aborted"] for res in results):
                raise WorkerLostError(f"steps {chunk['first'] + 1}-{chunk['last']}: a collective failed on rank(s) "
                                      f"{[r for r, res in enumerate(results) if res['aborted']]}")
            steps = results[0]["metrics"]
            self.preempted += [r for r, res in enumerate(results) if res["sigterm"] and r not in self.preempted]
            now = time.monotonic()
            count = chunk["last"] - chunk["first"]
            seconds = max(1e-9, now - last_done)
            last_done = now
            chunk_size = max(1, min(MAX_CHUNK, int(CHUNK_SECONDS * count / seconds)))
            records = [{"step": chunk["first"] + k + 1, "epoch": (chunk["first"] + k) // self.spe, **m,
                        "samples_per_s": cfg.batch_size * count / seconds, "world_size": self.group.world, "time": time.time()}
                       for k, m in enumerate(steps)]
            if self.recovering:
                record, detected = self.recovering
                record["recovery_s"] = now - detected  # failure noticed -> first step completed after it
                self.recovering = None
            if "eval" in chunk:
                records[-1].update(self.group.gather(chunk["eval"], time.monotonic() + cfg.step_timeout_s, "evaluation", "step_timeout_s")[0])
            self.history.extend(records)
            self.progress.update(chunk["last"], records[-1], force="eval" in chunk or chunk["last"] == self.total)
            if not self.expanding and self.group.pending_ready() and chunk["last"] < self.total:
                self.expanding = True  # a replacement is up: drain, then take it in
            if self.expanding and not inflight and chunk["last"] < self.total:
                self._expand(chunk["last"])
                chunk_size, last_done = 1, time.monotonic()
            if (self.preempted or self.sigterm) and not inflight and chunk["last"] < self.total:
                self._checkpoint_now(chunk, records[-1]["step"])
                if self.sigterm:
                    raise PreemptedError(
                        f"stopped by SIGTERM after step {chunk['last']}; checkpoint written to {self.checkpoint}: "
                        "fit(..., resume=True) continues from it"
                    )
                raise _Preempted(f"SIGTERM to rank(s) {self.preempted} (preemption): checkpoint taken at step {chunk['last']}")
            if "state" in chunk:
                self._save(chunk["state"], chunk["last"])
                if (chunk["last"] < self.total and self.group.world < cfg.workers and not self.group.pending
                        and cluster_capacity(self.bundle) > self.group.world):
                    raise _Regroup()
        self.store.wait()
        # The driver's copy may be read-only object-store memory: hand the user tensors of their own.
        state = _tree.map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, TrainState.from_dict(self.memory[1]))
        self._write_reports()
        self.model.load_state_dict({**state.params, **state.buffers}, strict=False)
        return Result(state=state, model=self.model, metrics=self.history, checkpoint=self.checkpoint, restarts=self.restarts)

    def _checkpoint_now(self, chunk: dict[str, Any], step: int) -> None:
        """A checkpoint at the current step, on disk before returning (preemption)."""
        if "state" not in chunk:
            chunk["state"] = self.group.actors[0].state_dict.remote()
        self._save(chunk["state"], step)
        self.store.wait()

    def _save(self, state_ref: Any, step: int) -> None:
        epoch, in_epoch = divmod(step, self.spe)
        manifest = {
            "step": step, "epoch": epoch, "cursor": {"epoch": epoch, "step_in_epoch": in_epoch},
            "world_size": self.group.world, "metrics": self.history[-1] if self.history else {},
            "config": _plain_config(self.cfg), "history": self.history, "restarts": self.restarts, "saved_at": time.time(),
        }
        self.store.save_async(state_ref, manifest, on_saved=self._saved)
        self._write_reports(plot=False)

    def _saved(self, path: str, step: int, state: dict[str, Any]) -> None:
        """Called by the writer thread once a checkpoint is on disk."""
        if self.memory is None or step >= self.memory[0]:
            self.memory, self.checkpoint = (step, state), path

    def _write_reports(self, plot: bool = True) -> None:
        write_jsonl(self.history, self.store.file("metrics.jsonl"), self.store.fs)
        if plot:
            write_plot(self.history, self.store.file("metrics.png"), self.store.fs)


def _plain_config(cfg: FitConfig) -> dict[str, Any]:
    out = {}
    for name in FitConfig.model_fields:
        value = getattr(cfg, name)
        out[name] = value if isinstance(value, (int, float, str, bool, type(None), dict)) else repr(value)
    out["mpi"] = cfg.mpi.model_dump()
    return out
