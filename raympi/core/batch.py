"""The batch format of a step: what ``train_step`` and ``eval_step`` accept, checked and taken apart.

A batch is ``(inputs, targets)`` or ``{"inputs": ..., "targets": ...}``;
:func:`split_batch` validates it and turns it into the positional and
keyword arguments of the model call, the targets and the local sample count,
with errors that show the accepted forms.  Part of the functional core:
torch alone.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from raympi.exceptions import TrainingError

__all__ = ["Batch", "split_batch", "correct_predictions"]

Batch = Any  # (inputs, targets) or {"inputs": ..., "targets": ...}

_BATCH_HELP = (
    "a batch must be a pair (inputs, targets) or a dict {'inputs': ..., 'targets': ...}; "
    "inputs is a tensor (model(inputs)), a tuple (model(*inputs)) or a dict "
    "(model(**inputs)); targets is a tensor whose first dimension is the batch"
)


def split_batch(batch: Batch) -> tuple[tuple[Any, ...], dict[str, Any], torch.Tensor, int]:
    """Check a batch and take it apart for the model call.

    Args:
        batch: ``(inputs, targets)`` or ``{"inputs": ..., "targets": ...}``.

    Returns:
        ``(args, kwargs, targets, n)``: the positional and keyword arguments of
        ``model(...)``, the targets and the local sample count.

    Raises:
        TrainingError: the batch has another form, no sample, or inputs and
            targets of different lengths; the message shows the accepted forms.
    """
    if isinstance(batch, dict):
        if set(batch) != {"inputs", "targets"}:
            raise TrainingError(f"batch dict has keys {sorted(batch)}: {_BATCH_HELP}")
        inputs, targets = batch["inputs"], batch["targets"]
    elif isinstance(batch, (tuple, list)) and len(batch) == 2:
        inputs, targets = batch
    else:
        raise TrainingError(f"got a batch of type {type(batch).__name__}: {_BATCH_HELP}")
    if not isinstance(targets, torch.Tensor) or targets.ndim == 0:
        raise TrainingError(f"targets is {type(targets).__name__} of no batch dimension: {_BATCH_HELP}")
    n = targets.shape[0]
    if n == 0:
        raise TrainingError("empty batch (0 samples): every rank needs at least one sample")
    if isinstance(inputs, torch.Tensor):
        if inputs.ndim == 0 or inputs.shape[0] != n:
            raise TrainingError(
                f"inputs of shape {tuple(inputs.shape)} and targets of shape "
                f"{tuple(targets.shape)} disagree on the batch size: {_BATCH_HELP}"
            )
        return (inputs,), {}, targets, n
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}, targets, n
    if isinstance(inputs, dict):
        return (), dict(inputs), targets, n
    raise TrainingError(f"inputs is a {type(inputs).__name__}: {_BATCH_HELP}")


def correct_predictions(outputs: Any, targets: torch.Tensor) -> Optional[torch.Tensor]:
    """Correct predictions when this looks like classification, else ``None``.

    Classification: integer class ids as targets and outputs of shape
    ``(N, C, ...)`` for targets ``(N, ...)``, the layout of ``F.cross_entropy``.

    Args:
        outputs: the model's outputs.
        targets: the batch's targets.

    Returns:
        The count of correct predictions (a 0-d tensor, not read to the host), or ``None``.
    """
    if (
        isinstance(outputs, torch.Tensor)
        and not targets.is_floating_point()
        and not targets.is_complex()
        and targets.dtype != torch.bool
        and outputs.ndim == targets.ndim + 1
    ):
        return (outputs.argmax(1) == targets).sum()
    return None
