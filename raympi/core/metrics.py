"""A step's statistics: the packed float64 tensor that rides the gradient allreduce, and the metrics read from it.

Part of the functional core (torch alone).  Each rank (and, with
accumulation, each micro-batch) contributes one *row* of sums:
``[loss * n, correct, n, n_targets, metric_1 * n, ...]``.  Rows add up, so
after the cross-rank sum the row holds the global sums and every mean is
global: ``sum(n * mean) / sum(n)``.  Reading it is the step's one host read.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from raympi.core.batch import correct_predictions
from raympi.exceptions import ConfigError, TrainingError

Metrics = dict[str, Any]
MetricFn = Callable[[Any, torch.Tensor], torch.Tensor]

# Keys the train step itself reports: a user metric may not take them (``accuracy`` may: it then
# replaces the automatic one).
RESERVED = ("loss", "samples", "loss_scale", "skipped", "nonfinite")
N_FIXED = 4  # loss * n, correct, n, n_targets


def _check_names(metric_fns: dict[str, MetricFn], reserved: tuple[str, ...], arg: str) -> list[str]:
    taken = sorted(set(metric_fns) & set(reserved))
    if taken:
        raise ConfigError(f"{arg} may not use the names {taken}: the step reports its own values under them")
    bad = [n for n, f in metric_fns.items() if not callable(f)]
    if bad:
        raise ConfigError(f"{arg} maps names to functions fn(outputs, targets) -> scalar mean; {bad} are not callable")
    return list(metric_fns)


def _metric_value(name: str, value: Any) -> torch.Tensor:
    """A metric function's result as a float64 0-d tensor, or a clear error."""
    if not isinstance(value, torch.Tensor) or value.ndim != 0:
        raise TrainingError(
            f"metric {name!r} must return a scalar tensor (the mean over the batch), got {value!r:.80}"
        )
    return value.detach().to(torch.float64)


def _row(
    loss: torch.Tensor, outputs: Any, targets: torch.Tensor, n: int, metric_fns: dict[str, MetricFn], names: list[str]
) -> tuple[torch.Tensor, bool]:
    """One batch's row of sums, and whether it counts correct predictions (classification)."""
    correct = correct_predictions(outputs, targets) if "accuracy" not in metric_fns else None
    zero = torch.zeros((), dtype=torch.float64, device=loss.device)
    values = [
        loss.detach().double() * n,
        correct.to(loss.device, torch.float64) if correct is not None else zero,
        zero + n,
        zero + targets.numel(),
    ]
    values += [_metric_value(k, metric_fns[k](outputs, targets)).to(loss.device) * n for k in names]
    return torch.stack(values), correct is not None


def _read(values: list[float], names: list[str], classify: bool) -> tuple[Metrics, float]:
    """The summed row as metrics (global means), and the global loss sum."""
    loss_sum, n_correct, total, n_targets = values[:N_FIXED]
    metrics: Metrics = {"loss": loss_sum / total, "samples": int(total)}
    if classify:
        metrics["accuracy"] = n_correct / n_targets
    for name, s in zip(names, values[N_FIXED:]):
        metrics[name] = s / total
    return metrics, loss_sum


def _means_to_sums(outputs: Any, targets: torch.Tensor, n: int, metric_fns: dict[str, MetricFn],
                   names: list[str]) -> list[float]:
    """``n * metric`` for each name, read to the host at once (eval: sums add up over batches)."""
    values = [_metric_value(k, metric_fns[k](outputs, targets)) for k in names]
    return [m * n for m in torch.stack([v.to(values[0].device) for v in values]).tolist()] if values else []
