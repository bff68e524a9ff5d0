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

from raympi import data, optim
from raympi._state import TrainState
from raympi._step import make_train_step
from raympi.checkpoint import CheckpointStore
from raympi.config import FitConfig, parse_config
from raympi.exceptions import TrainingError
from raympi.group import WorkerGroup
from raympi.report import Progress, write_jsonl, write_plot

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
    inputs, targets = data.as_tensors(dataset)
    eval_data = data.as_tensors(cfg.eval_dataset, "eval_dataset") if cfg.eval_dataset is not None else None
    steps_per_epoch = data.steps_per_epoch(len(inputs), cfg.batch_size)
    _dry_run(model, loss_fn, optimizer, inputs, targets, cfg)
    root = cfg.checkpoint_dir or os.path.join("runs", "raympi-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    store = CheckpointStore(root, cfg.keep_checkpoints)
    started_ray = _connect_ray(cfg)
    try:
        return _Run(cfg, model, loss_fn, optimizer, (inputs, targets), eval_data, steps_per_epoch, store).run()
    finally:
        store.close()
        if started_ray:
            ray.shutdown()


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
    if address:
        ray.init(address=address, logging_level="ERROR")
        return False
    ray.init(address="local", include_dashboard=False, logging_level="ERROR")
    return True


class _Run:
    """One call of :func:`fit`: the data cursor, the chunk pipeline, checkpoints and metrics."""

    def __init__(self, cfg, model, loss_fn, optimizer, train_data, eval_data, steps_per_epoch, store) -> None:
        self.cfg, self.model, self.store = cfg, model, store
        self.spe = steps_per_epoch
        self.total = min(steps_per_epoch * cfg.epochs, cfg.max_steps or steps_per_epoch * cfg.epochs)
        self.history: list[dict[str, Any]] = []
        self.checkpoint: str | None = None
        self.num_samples = len(train_data[0])
        self.eval_size = len(eval_data[0]) if eval_data is not None else 0
        self._orders: dict[int, torch.Tensor] = {}
        self.start_step, state = 0, None
        if cfg.resume:
            found = store.latest()
            if found is not None:
                self.checkpoint, manifest, state = found
                self.start_step = int(manifest["step"])
                self.history = [r for r in manifest.get("history", []) if r["step"] <= self.start_step]
        refs = tuple(ray.put(x.numpy() if x.dtype != torch.bfloat16 else x) for x in train_data)
        eval_refs = tuple(ray.put(x.numpy() if x.dtype != torch.bfloat16 else x) for x in eval_data) if eval_data else (None, None)
        use_gpu = cfg.use_gpu if cfg.use_gpu is not None else ray.cluster_resources().get("GPU", 0) >= 1
        self.group = WorkerGroup(cfg, (model, loss_fn, optimizer, *refs, *eval_refs), state, use_gpu)

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            self._orders = {epoch: data.epoch_order(self.cfg.seed, epoch, self.num_samples)}
        return self._orders[epoch]

    def run(self) -> Result:
        try:
            return self._loop()
        finally:
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
        world = self.cfg.workers
        shards: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for s in range(first, first + count):
            epoch, i = divmod(s, self.spe)
            batch = self._order(epoch)[i * self.cfg.batch_size : (i + 1) * self.cfg.batch_size]
            for rank, part in enumerate(data.rank_slices(batch, world)):
                shards[rank].append(part)
        actors = self.group.actors
        chunk = {"first": first, "last": first + count, "refs": [a.run.remote(shards[r], self.cfg.batch_size) for r, a in enumerate(actors)]}
        last = first + count
        if self._wants_eval(last):
            parts = torch.tensor_split(torch.arange(self.eval_size), world)
            chunk["eval"] = [a.evaluate.remote(parts[r]) for r, a in enumerate(actors)]
        if last == self.total or (self.cfg.checkpoint_every and last % self.cfg.checkpoint_every == 0):
            chunk["state"] = actors[0].state_dict.remote()
        return chunk

    def _loop(self) -> Result:
        cfg = self.cfg
        progress = Progress(self.total, cfg.progress)
        inflight: deque[dict[str, Any]] = deque()
        next_step, chunk_size, last_done = self.start_step, 1, time.monotonic()
        final_state_ref = None
        while next_step < self.total or inflight:
            while len(inflight) < 2 and next_step < self.total:
                count = min(chunk_size, self._boundary(next_step) - next_step)
                inflight.append(self._submit(next_step, count))
                next_step += count
            chunk = inflight.popleft()
            deadline = max(last_done, time.monotonic()) + cfg.step_timeout_s
            steps = self.group.gather(chunk["refs"], deadline, f"steps {chunk['first'] + 1}-{chunk['last']}", "step_timeout_s")[0]
            now = time.monotonic()
            count = chunk["last"] - chunk["first"]
            seconds = max(1e-9, now - last_done)
            last_done = now
            chunk_size = max(1, min(MAX_CHUNK, int(CHUNK_SECONDS * count / seconds)))
            records = [{"step": chunk["first"] + k + 1, "epoch": (chunk["first"] + k) // self.spe, **m,
                        "samples_per_s": cfg.batch_size * count / seconds, "world_size": cfg.workers, "time": time.time()}
                       for k, m in enumerate(steps)]
            if "eval" in chunk:
                records[-1].update(self.group.gather(chunk["eval"], time.monotonic() + cfg.step_timeout_s, "evaluation", "step_timeout_s")[0])
            self.history.extend(records)
            progress.update(chunk["last"], records[-1], force="eval" in chunk or chunk["last"] == self.total)
            if "state" in chunk:
                final_state_ref = chunk["state"]
                self._save(chunk["state"], chunk["last"])
        progress.close()
        if final_state_ref is None:  # resumed at the very end: nothing left to run
            final_state_ref = self.group.actors[0].state_dict.remote()
        state = TrainState.from_dict(ray.get(final_state_ref, timeout=cfg.step_timeout_s))
        self.store.wait()
        self._write_reports()
        self.model.load_state_dict({**state.params, **state.buffers}, strict=False)
        return Result(state=state, model=self.model, metrics=self.history, checkpoint=self.checkpoint, restarts=[])

    def _save(self, state_ref: Any, step: int) -> None:
        epoch, in_epoch = divmod(step, self.spe)
        manifest = {
            "step": step, "epoch": epoch, "cursor": {"epoch": epoch, "step_in_epoch": in_epoch},
            "world_size": self.cfg.workers, "metrics": self.history[-1] if self.history else {},
            "config": _plain_config(self.cfg), "history": self.history, "saved_at": time.time(),
        }
        future = self.store.save_async(state_ref, manifest)
        future.add_done_callback(lambda f: setattr(self, "checkpoint", f.result()) if not f.exception() else None)
        self._write_reports(plot=False)

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
