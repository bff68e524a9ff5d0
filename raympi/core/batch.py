"""The batch format of a step: what ``train_step`` and ``eval_step`` accept, checked and taken apart.

A batch is ``(inputs, targets)`` or ``{"inputs": ..., "targets": ...}``, or a dict of inputs alone
(``model(**batch)``; a Hugging Face batch whose ``labels`` the model turns into its own loss);
:func:`split_batch` validates it and turns it into the positional and
keyword arguments of the model call, the targets and the local sample count,
with errors that show the accepted forms.  Part of the functional core:
torch alone.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from torch.func import functional_call

from raympi.exceptions import TrainingError

__all__ = ["Batch", "call_model", "split_batch", "correct_predictions"]

Batch = Any  # (inputs, targets), {"inputs": ..., "targets": ...}, or a dict of inputs alone

_BATCH_HELP = (
    "a batch must be a pair (inputs, targets), a dict {'inputs': ..., 'targets': ...}, or a dict of inputs "
    "alone (model(**batch), for a model that computes its own loss, from labels among its inputs); "
    "inputs is a tensor (model(inputs)), a tuple (model(*inputs)) or a dict "
    "(model(**inputs)); targets is a tensor whose first dimension is the batch"
)


def split_batch(batch: Batch) -> tuple[tuple[Any, ...], dict[str, Any], Optional[torch.Tensor], int]:
    """Check a batch and take it apart for the model call.

    Args:
        batch: ``(inputs, targets)``, ``{"inputs": ..., "targets": ...}`` or a dict of inputs alone.

    Returns:
        ``(args, kwargs, targets, n)``: the positional and keyword arguments of
        ``model(...)``, the targets (``None`` for a dict of inputs alone) and the local sample count.

    Raises:
        TrainingError: the batch has another form, no sample, or inputs and
            targets of different lengths; the message shows the accepted forms.
    """
    if isinstance(batch, dict) and set(batch) != {"inputs", "targets"}:
        return (), dict(batch), None, _inputs_length(batch)
    if isinstance(batch, dict):
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


def call_model(model: torch.nn.Module, tensors: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``model(*args, **kwargs)`` with ``tensors`` as its parameters and buffers (``functional_call``).

    Raises:
        TrainingError: the model does not take the batch's keywords (a dict batch of other keys).
    """
    try:
        return functional_call(model, tensors, args, kwargs)
    except TypeError as exc:
        if not kwargs or "argument" not in str(exc):
            raise
        raise TrainingError(
            f"model(**batch) with the keys {sorted(kwargs)} raised TypeError: {exc}. {_BATCH_HELP}"
        ) from exc


def _inputs_length(inputs: dict[str, Any]) -> int:
    """The sample count of a dict of inputs alone: the first dimension of its first batched tensor."""
    n = next((v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor) and v.ndim > 0), 0)
    if n == 0:
        raise TrainingError(f"a batch of inputs alone (keys {sorted(inputs)}) holds no sample: {_BATCH_HELP}")
    return int(n)


def correct_predictions(outputs: Any, targets: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
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
        and targets is not None
        and not targets.is_floating_point()
        and not targets.is_complex()
        and targets.dtype != torch.bool
        and outputs.ndim == targets.ndim + 1
    ):
        return (outputs.argmax(1) == targets).sum()
    return None
