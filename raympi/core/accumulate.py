"""Gradient accumulation: a rank's batch cut into micro-batches that run one after the other.

Part of the functional core (torch alone).  ``train_step`` with
``accumulate=k`` runs the forward and backward pass on each micro-batch,
scales each micro-batch's mean loss by ``micro_n / global_n`` (the
global-batch rule, one level down) and sums the gradients locally, so the
one cross-rank sum of the step sees the same gradient as without
accumulation, up to floating-point summation order, while only a
micro-batch's activations are alive at a time.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from raympi.core import pytree
from raympi.exceptions import ConfigError

__all__ = ["MicroBatch", "check_accumulate", "micro_batches"]

# model args, model kwargs, targets, sample count
MicroBatch = tuple[tuple[Any, ...], dict[str, Any], Optional[torch.Tensor], int]


def check_accumulate(accumulate: Any) -> int:
    """Check ``make_train_step``'s ``accumulate``: an int >= 1 (not a bool); returned as is.

    Raises:
        ConfigError: any other value.
    """
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ConfigError(f"accumulate must be an int >= 1 (micro-batches per step), got {accumulate!r}")
    return accumulate


def micro_batches(
    args: tuple[Any, ...], kwargs: dict[str, Any], targets: Optional[torch.Tensor], n: int, k: int
) -> list[MicroBatch]:
    """Cut a batch into ``min(k, n)`` micro-batches along dim 0, sizes differing by at most one.

    ``torch.tensor_split`` cuts the targets and every input tensor whose first
    dimension is the batch (``n``); any other input (a 0-d tensor, a tensor of
    another length, a non-tensor) goes whole to every micro-batch.  The
    pieces are views: no copy.

    Args:
        args, kwargs, targets, n: a batch as :func:`~raympi.core.batch.split_batch` returns it.
        k: the micro-batches wanted.

    Returns:
        ``[(args, kwargs, targets, n), ...]``, one per micro-batch.
    """
    k = min(k, n)  # no empty micro-batch
    if k == 1:
        return [(args, kwargs, targets, n)]
    leaves, spec = pytree.flatten((args, kwargs))
    pieces = [
        torch.tensor_split(x, k) if isinstance(x, torch.Tensor) and x.ndim > 0 and x.shape[0] == n else [x] * k
        for x in leaves
    ]
    sizes = [len(part) for part in torch.tensor_split(torch.arange(n), k)]
    cut = torch.tensor_split(targets, k) if targets is not None else [None] * k
    return [(*pytree.unflatten([p[i] for p in pieces], spec), cut[i], sizes[i]) for i in range(k)]
