"""Experiment loggers, as callbacks (see :mod:`raympi.driver.callbacks`): TensorBoard, MLflow and Weights & Biases.

Each logs the run's options as params once (``on_start``), every numeric metric per step and per
evaluation, and each restart (``restarts`` and ``world_size`` at the step it resumed from); TensorBoard
also each rank's time a step (``on_ranks``).  Each needs its package, an optional extra:
``pip install 'raympi[tensorboard]'``, ``'raympi[mlflow]'``, ``'raympi[wandb]'``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from raympi.driver.report import TIMES, ms_per_step

__all__ = ["MLflow", "TensorBoard", "WandB"]

_NOT_METRICS = ("step", "epoch", "time")


def _require(module: str, extra: str, what: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{what} needs the {extra} package: pip install 'raympi[{extra}]' ({exc})") from None


def numbers(record: dict[str, Any], evaluation: bool) -> dict[str, float]:
    """The numeric metrics of a step record: the ``eval_*`` ones for an evaluation, the others otherwise."""
    return {
        key: float(value)
        for key, value in record.items()
        if key not in _NOT_METRICS
        and key.startswith("eval_") == evaluation
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
    }


class TensorBoard:
    """Write every numeric metric as a TensorBoard scalar (``pip install 'raympi[tensorboard]'``), and after every
    chunk of steps each rank's ms a step waiting for data, computing and in collectives (``rank/data_ms/R``,
    ``rank/compute_ms/R``, ``rank/collective_ms/R`` for rank ``R``, at the chunk's last step).

    Args:
        log_dir: where the event files go (one run per folder).

    Example:
        >>> raympi.fit(model, data, callbacks=[TensorBoard("runs/tb")])  # doctest: +SKIP
    """

    def __init__(self, log_dir: str) -> None:
        tensorboard = _require("torch.utils.tensorboard", "tensorboard", "TensorBoard")
        self.writer = tensorboard.SummaryWriter(log_dir)

    def _write(self, record: dict[str, Any], evaluation: bool) -> None:
        for key, value in numbers(record, evaluation).items():
            self.writer.add_scalar(key, value, record["step"])

    def on_step(self, record: dict[str, Any]) -> None:
        self._write(record, evaluation=False)

    def on_eval(self, record: dict[str, Any]) -> None:
        self._write(record, evaluation=True)
        self.writer.flush()

    def on_ranks(self, line: dict[str, Any]) -> None:
        """Each rank's ms a step waiting for data, computing and in collectives: ``rank/compute_ms/0``, ..."""
        for key in TIMES:
            for rank, ms in enumerate(ms_per_step(line, key)):
                self.writer.add_scalar(f"rank/{key.removesuffix('_s')}_ms/{rank}", ms, line["step"])

    def on_restart(self, record: dict[str, Any]) -> None:
        self.writer.add_scalar("restarts/world_after", record.get("world_after", 0), record["step"])

    def on_end(self, records: list[dict[str, Any]]) -> None:
        self.writer.close()


class MLflow:
    """Log the run to MLflow (``pip install 'raympi[mlflow]'``): params, metrics per step and per
    evaluation (buffered, sent every ``flush_every`` steps and at each evaluation, checkpoint and the
    end), the checkpoints' paths as tags, and restarts.

    Args:
        tracking_uri: an MLflow tracking server or store; default a local file store, ``./mlruns``.
        experiment: the experiment's name (created when missing).
        run_name: the run's name; default MLflow's.
        flush_every: steps between sends.

    Example:
        >>> raympi.fit(model, data, callbacks=[MLflow(experiment="mnist")])  # doctest: +SKIP
        >>> # then: mlflow ui --backend-store-uri ./mlruns
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = "raympi",
        run_name: str | None = None,
        flush_every: int = 50,
    ) -> None:
        tracking = _require("mlflow.tracking", "mlflow", "MLflow")
        self.entities = _require("mlflow.entities", "mlflow", "MLflow")
        if tracking_uri is None:  # MLflow 3 keeps its file store for those who ask for it by this variable
            tracking_uri = "file://" + os.path.abspath("mlruns")
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = tracking.MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id: str = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self.flush_every = flush_every
        self.pending: list[Any] = []
        self.restarts = 0

    def _log(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.pending += [self.entities.Metric(key, value, now, step) for key, value in values.items()]

    def _flush(self) -> None:
        for start in range(0, len(self.pending), 1000):  # MLflow takes at most 1000 metrics a call
            self.client.log_batch(self.run_id, metrics=self.pending[start : start + 1000])
        self.pending = []

    def on_start(self, params: dict[str, Any]) -> None:
        self.client.log_batch(self.run_id, params=[self.entities.Param(k, str(v)[:500]) for k, v in params.items()])

    def on_step(self, record: dict[str, Any]) -> None:
        self._log(numbers(record, evaluation=False), record["step"])
        if record["step"] % self.flush_every == 0:
            self._flush()

    def on_eval(self, record: dict[str, Any]) -> None:
        self._log(numbers(record, evaluation=True), record["step"])
        self._flush()

    def on_checkpoint(self, path: str, step: int) -> None:
        self._flush()
        self.client.set_tag(self.run_id, "raympi.checkpoint", path)

    def on_restart(self, record: dict[str, Any]) -> None:
        self.restarts += 1
        self._log({"restarts": self.restarts, "world_size": record.get("world_after", 0)}, record["step"])
        self._flush()

    def on_end(self, records: list[dict[str, Any]]) -> None:
        self._flush()
        self.client.set_terminated(self.run_id, "FINISHED")

    def on_error(self, error: BaseException) -> None:
        self._flush()
        stopped = isinstance(error, (KeyboardInterrupt, SystemExit))  # Ctrl-C, a Tune scheduler's stop
        self.client.set_terminated(self.run_id, "KILLED" if stopped else "FAILED")


class WandB:
    """Log the run to Weights & Biases (``pip install 'raympi[wandb]'``): the options as its config,
    metrics per step and per evaluation, and restarts.

    Args:
        project: the W&B project.
        mode: ``"online"``, ``"offline"`` (files under ``dir``, ``wandb sync`` them later) or ``"disabled"``;
            default W&B's own (``WANDB_MODE``, else online).
        dir: where W&B writes its files; default the working directory.
        **init: more arguments of ``wandb.init`` (``name``, ``entity``, ``tags``, ...).

    Example:
        >>> raympi.fit(model, data, callbacks=[WandB("mnist", mode="offline")])  # doctest: +SKIP
    """

    def __init__(self, project: str = "raympi", mode: str | None = None, dir: str | None = None, **init: Any) -> None:
        self.wandb = _require("wandb", "wandb", "WandB")
        self.init = {"project": project, "mode": mode, "dir": dir, **init}
        self.run: Any = None
        self.restarts = 0

    def on_start(self, params: dict[str, Any]) -> None:
        self.run = self.wandb.init(config=params, **self.init)

    def on_step(self, record: dict[str, Any]) -> None:
        self.run.log({**numbers(record, evaluation=False), "epoch": record.get("epoch", 0)}, step=record["step"])

    def on_eval(self, record: dict[str, Any]) -> None:
        self.run.log(numbers(record, evaluation=True), step=record["step"])

    def on_restart(self, record: dict[str, Any]) -> None:
        self.restarts += 1
        self.run.log({"restarts": self.restarts, "world_size": record.get("world_after", 0)}, step=record["step"])

    def on_end(self, records: list[dict[str, Any]]) -> None:
        self.run.finish()

    def on_error(self, error: BaseException) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1)
