"""Callbacks: user code the driver calls as the run goes (``fit(..., callbacks=[...])``).

A callback is any object with some of these methods; each runs on the driver, never on a worker:

* ``on_start(params)``: once, before the workers start, with the run's options (``workers``,
  ``batch_size``, ...: the plain values) and the model's parameter count.
* ``on_step(record)``: after every step, with its metrics record (step, epoch, loss, ...).
* ``on_eval(record)``: after an evaluation, with the record of the step it followed (``eval_*`` keys).
* ``on_ranks(line)``: after every chunk of steps, with where each rank's time went (a line of ``ranks.jsonl``:
  ``step``, ``steps``, ``world``, and ``data_s``, ``compute_s``, ``collective_s`` in rank order).
* ``on_checkpoint(path, step)``: once a checkpoint is on storage.
* ``on_restart(record)``: after a recovery, with its restart record.
* ``on_end(records)``: once, when the run ends (normally or stopped early).
* ``on_error(error)``: instead of ``on_end``, when the run stops with an exception (Ctrl-C included).

``on_step`` and ``on_eval`` may return ``True`` to stop the run early: the driver finishes the steps
in flight, writes a checkpoint and returns the :class:`~raympi.Result` as usual.  Built in:
:class:`EarlyStopping`, and the loggers :class:`TensorBoard`, :class:`MLflow` and :class:`WandB`
(:mod:`raympi.driver.loggers`).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from raympi.driver.loggers import MLflow, TensorBoard, WandB

__all__ = ["Callback", "EarlyStopping", "MLflow", "TensorBoard", "WandB", "Dispatcher", "run_params"]


class Callback:
    """Base class with every method doing nothing; subclass and override what you need."""

    def on_start(self, params: dict[str, Any]) -> None:
        return None

    def on_step(self, record: dict[str, Any]) -> bool | None:
        return None

    def on_eval(self, record: dict[str, Any]) -> bool | None:
        return None

    def on_ranks(self, line: dict[str, Any]) -> None:
        return None

    def on_checkpoint(self, path: str, step: int) -> None:
        return None

    def on_restart(self, record: dict[str, Any]) -> None:
        return None

    def on_end(self, records: list[dict[str, Any]]) -> None:
        return None

    def on_error(self, error: BaseException) -> None:
        return None


class EarlyStopping(Callback):
    """Stop when an evaluation metric has not improved for ``patience`` evaluations.

    Args:
        metric: a key of the eval records, e.g. ``"eval_loss"`` or ``"eval_accuracy"``.
        patience: evaluations without improvement before stopping.
        mode: ``"min"`` (lower is better) or ``"max"``.
        min_delta: the least change that counts as an improvement.

    Example:
        >>> raympi.fit(  # doctest: +SKIP
        ...     model, data, eval_dataset=held_out, callbacks=[EarlyStopping("eval_loss", patience=3)]
        ... )
    """

    def __init__(self, metric: str = "eval_loss", patience: int = 3, mode: str = "min", min_delta: float = 0.0) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        self.metric, self.patience, self.mode, self.min_delta = metric, patience, mode, min_delta
        self.best = math.inf if mode == "min" else -math.inf
        self.bad = 0
        self.stopped_at: int | None = None

    def on_eval(self, record: dict[str, Any]) -> bool:
        value = record.get(self.metric)
        if value is None:
            raise KeyError(f"EarlyStopping: no {self.metric!r} in the evaluation record (keys: {sorted(record)})")
        better = value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta
        self.best, self.bad = (value, 0) if better else (self.best, self.bad + 1)
        if self.bad >= self.patience:
            self.stopped_at = self.stopped_at or record["step"]
            return True
        return False


class Dispatcher:
    """Calls each callback's methods that exist.  A callback that raises stops the run like any error in user code."""

    def __init__(self, callbacks: Iterable[Any]) -> None:
        self.callbacks = list(callbacks)

    def _call(self, method: str, *args: Any) -> bool:
        stop = False
        for callback in self.callbacks:
            fn = getattr(callback, method, None)
            if fn is None:
                continue
            stop = bool(fn(*args)) or stop
        return stop

    def steps(self, records: list[dict[str, Any]]) -> bool:
        """Returns True when a callback asks to stop."""
        stop = False
        for record in records:
            stop = self._call("on_step", record) or stop
            if any(k.startswith("eval_") for k in record):
                stop = self._call("on_eval", record) or stop
        return stop

    def start(self, params: dict[str, Any]) -> None:
        self._call("on_start", params)

    def ranks(self, line: dict[str, Any]) -> None:
        self._call("on_ranks", line)

    def checkpoint(self, path: str, step: int) -> None:
        self._call("on_checkpoint", path, step)

    def restart(self, record: dict[str, Any]) -> None:
        self._call("on_restart", record)

    def end(self, records: list[dict[str, Any]]) -> None:
        self._call("on_end", records)

    def error(self, error: BaseException) -> None:
        """Tells each callback the run failed; a callback that fails here is not allowed to hide ``error``."""
        for callback in self.callbacks:
            try:
                getattr(callback, "on_error", lambda _: None)(error)
            except Exception:
                pass


def run_params(cfg: Any, shapes: dict[str, list[int]]) -> dict[str, Any]:
    """The run's options as a logger's params: the plain values (numbers, strings, flags, resources),
    and the parameter count of a model of these parameter ``shapes``."""
    out: dict[str, Any] = {"num_params": sum(math.prod(shape) for shape in shapes.values())}
    for name in type(cfg).model_fields:
        value = getattr(cfg, name)
        if isinstance(value, (int, float, str, bool)) or (isinstance(value, dict) and name == "resources_per_worker"):
            out[name] = value
    return out
