"""A step's statistics: the packed float64 tensor that rides the gradient allreduce, and the metrics read from it.

Part of the functional core (torch alone).  Each rank (and, with
accumulation, each micro-batch) contributes one *row* of sums, laid out as
:class:`StatsLayout` says: ``[loss * n, correct, n, n_targets, metric_1 * n,
...]``, then fp16's overflow flags.  Rows add up, so after the cross-rank sum
the row holds the global sums and every mean is global: ``sum(n * mean) /
sum(n)``.  Reading it is the step's one host read.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, NamedTuple, Optional

import torch

from raympi.core.batch import correct_predictions
from raympi.exceptions import ConfigError, TrainingError

__all__ = [
    "Metrics",
    "MetricFn",
    "RESERVED",
    "StatsLayout",
    "StepStats",
    "check_metric_names",
    "stats_row",
    "read_stats",
    "means_to_sums",
]

#: What a step reports, metric name -> value.
Metrics = dict[str, Any]
#: A user metric, ``fn(outputs, targets)`` -> the mean over the samples given.
MetricFn = Callable[[Any, Optional[torch.Tensor]], torch.Tensor]

#: Keys the train step itself reports, which a user metric may not take (``accuracy`` may; it then
#: replaces the automatic one).
RESERVED = ("loss", "samples", "loss_scale", "skipped", "nonfinite")


@dataclasses.dataclass(frozen=True)
class StatsLayout:
    """Which index of a step's statistics row holds what.

    A row is ``[LOSS_SUM, CORRECT, SAMPLES, TARGETS, metric sums...]``; with
    fp16 (``overflow_flags``) two flags follow: :attr:`rank_overflows`, 1.0
    where this rank's own gradients held an inf/NaN, appended *before* the
    cross-rank sum (so the sum counts the ranks that overflowed), and
    :attr:`sum_overflow`, the ``found_inf`` of unscaling the *summed*
    gradients, appended after it.

    Attributes:
        metric_names: the user metrics, in row order.
        overflow_flags: whether the row carries fp16's two overflow flags.

    Example:
        >>> layout = StatsLayout(("mae",), overflow_flags=True)
        >>> layout.metric("mae"), layout.rank_overflows, layout.sum_overflow
        (4, 5, 6)
    """

    metric_names: tuple[str, ...] = ()
    overflow_flags: bool = False

    LOSS_SUM: ClassVar[int] = 0  # sum of the per-sample losses (local mean loss * n)
    CORRECT: ClassVar[int] = 1  # correct predictions (0 where not classification)
    SAMPLES: ClassVar[int] = 2  # samples
    TARGETS: ClassVar[int] = 3  # target elements (accuracy's denominator)
    FIXED: ClassVar[int] = 4  # where the metric sums begin

    def metric(self, name: str) -> int:
        """The index of user metric ``name``'s sum."""
        return self.FIXED + self.metric_names.index(name)

    @property
    def rank_overflows(self) -> int:
        """The index of the count of ranks whose own gradients overflowed (fp16 only)."""
        return self.FIXED + len(self.metric_names)

    @property
    def sum_overflow(self) -> int:
        """The index of the summed gradients' ``found_inf`` (fp16 only; appended after the sum)."""
        return self.rank_overflows + 1


class StepStats(NamedTuple):
    """A summed row, read: what the step reports and what it decides on."""

    metrics: Metrics  # global means: "loss", "samples", "accuracy" (classification), each user metric
    loss_sum: float  # the global sum of the losses: a NaN/inf here is a non-finite loss
    overflow: bool  # fp16: some rank's gradients, or their sum, held an inf/NaN (False without fp16)


def check_metric_names(metric_fns: dict[str, MetricFn], reserved: tuple[str, ...], arg: str) -> list[str]:
    """Check user metrics: callables, under no reserved name.

    Args:
        metric_fns: name -> ``fn(outputs, targets) -> scalar mean``.
        reserved: names the step reports itself (:data:`RESERVED` for a train step).
        arg: the argument's name, for the error message.

    Returns:
        The metric names, in their given order.

    Raises:
        ConfigError: a reserved name, or a value that is not callable.
    """
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
        raise TrainingError(f"metric {name!r} must return a scalar tensor (the mean over the batch), got {value!r:.80}")
    return value.detach().to(torch.float64)


def stats_row(
    loss: torch.Tensor,
    outputs: Any,
    targets: Optional[torch.Tensor],
    n: int,
    metric_fns: dict[str, MetricFn],
    layout: StatsLayout,
) -> tuple[torch.Tensor, bool]:
    """One batch's row of sums, without the overflow flags; no host read.

    Args:
        loss: the batch's mean loss (0-d).
        outputs: the model's outputs; targets: the batch's targets; n: its sample count.
        metric_fns: the user metrics, each a mean over the batch.
        layout: the row's layout (its ``metric_names`` pick from ``metric_fns``).

    Returns:
        ``(row, classify)``: a float64 tensor on the loss's device, and whether
        the row counts correct predictions (classification).
    """
    correct = correct_predictions(outputs, targets) if "accuracy" not in metric_fns else None
    zero = torch.zeros((), dtype=torch.float64, device=loss.device)
    values = [
        loss.detach().double() * n,  # LOSS_SUM
        correct.to(loss.device, torch.float64) if correct is not None else zero,  # CORRECT
        zero + n,  # SAMPLES
        zero + (targets.numel() if targets is not None else 0),  # TARGETS
    ]
    values += [_metric_value(k, metric_fns[k](outputs, targets)).to(loss.device) * n for k in layout.metric_names]
    return torch.stack(values), correct is not None


def read_stats(values: list[float], layout: StatsLayout, classify: bool) -> StepStats:
    """The summed row (as read to the host) as metrics and decisions.

    Args:
        values: the row summed over ranks and micro-batches, as a list.
        layout: its layout.
        classify: whether the row counted correct predictions (reports ``"accuracy"``).

    Returns:
        A :class:`StepStats`.
    """
    loss_sum, total = values[layout.LOSS_SUM], values[layout.SAMPLES]
    metrics: Metrics = {"loss": loss_sum / total, "samples": int(total)}
    if classify:
        metrics["accuracy"] = values[layout.CORRECT] / values[layout.TARGETS]
    for i, name in enumerate(layout.metric_names, start=layout.FIXED):
        metrics[name] = values[i] / total
    overflow = layout.overflow_flags and (values[layout.rank_overflows] > 0 or values[layout.sum_overflow] > 0)
    return StepStats(metrics, loss_sum, overflow)


def means_to_sums(
    outputs: Any, targets: Optional[torch.Tensor], n: int, metric_fns: dict[str, MetricFn], names: list[str]
) -> list[float]:
    """``n * metric`` for each name, read to the host at once (eval: sums add up over batches).

    Args:
        outputs, targets, n: one batch's outputs, targets and sample count.
        metric_fns: name -> ``fn(outputs, targets) -> scalar mean``.
        names: the names to compute, in order.

    Returns:
        The sums, Python floats, in the order of ``names``.
    """
    values = [_metric_value(k, metric_fns[k](outputs, targets)) for k in names]
    return [m * n for m in torch.stack([v.to(values[0].device) for v in values]).tolist()] if values else []
