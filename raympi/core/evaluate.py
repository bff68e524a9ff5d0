"""``make_eval_step``: evaluation as a pure function of a ``TrainState``.

The functional core's read-only twin of ``train_step`` (torch alone): the
model runs in eval mode without gradients on the state's tensors and each
metric comes back as a SUM over the batch, so sums add up across batches and
ranks and the caller divides once by the total sample count.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from raympi.core.batch import Batch, call_model, split_batch
from raympi.core.metrics import MetricFn, Metrics, check_metric_names, means_to_sums
from raympi.core.mode import in_mode
from raympi.core.state import TrainState

__all__ = ["make_eval_step"]


def make_eval_step(model: nn.Module, metric_fns: dict[str, MetricFn]) -> Callable[[TrainState, Batch], Metrics]:
    """Build ``eval_step(state, batch) -> metrics``, run in eval mode without gradients.

    Each ``metric_fns[name](outputs, targets)`` returns the MEAN over the
    batch (a scalar); ``eval_step`` returns it multiplied back to a SUM, plus
    ``"samples"``, all Python numbers.  Sums add up across batches and ranks,
    so the global mean is ``sum(m[name]) / sum(m["samples"])``.

    Args:
        model: the ``nn.Module`` whose forward is used (in eval mode).
        metric_fns: name -> ``fn(outputs, targets) -> scalar mean``.  The name
            ``"samples"`` is reserved.

    Returns:
        ``eval_step``, a pure function of ``(state, batch)``; the batch format
        is :func:`~raympi.core.step.make_train_step`'s.

    Raises:
        ConfigError: a metric is named ``"samples"`` or is not callable.

    Example:
        >>> ev = make_eval_step(model, {"loss": F.cross_entropy,
        ...     "accuracy": lambda o, t: (o.argmax(1) == t).float().mean()})
        >>> sums = [ev(state, b) for b in batches]
        >>> acc = sum(s["accuracy"] for s in sums) / sum(s["samples"] for s in sums)
    """
    names = check_metric_names(metric_fns, ("samples",), "metric_fns")

    def eval_step(state: TrainState, batch: Batch) -> Metrics:
        args, kwargs, targets, n = split_batch(batch)
        with in_mode(model, False), torch.no_grad():
            outputs = call_model(model, (state.params, state.buffers), args, kwargs)
            sums = means_to_sums(outputs, targets, n, metric_fns, names)
        out: Metrics = dict(zip(names, sums))
        out["samples"] = n
        return out

    return eval_step
