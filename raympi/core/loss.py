"""The loss a step uses when none is given: the model's own, else cross-entropy.

Part of the functional core (torch alone).  A model that computes its own loss, as Hugging Face
models do when ``labels`` is among their inputs, returns it as ``outputs.loss`` (a ``ModelOutput``)
or ``outputs["loss"]`` (a dict); that loss is used as it is, the mean over the samples given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.nn.functional as F

from raympi.exceptions import TrainingError

__all__ = ["default_loss", "own_loss"]


def own_loss(outputs: Any) -> Optional[torch.Tensor]:
    """The loss the model computed itself (``outputs.loss`` or ``outputs["loss"]``), or ``None``."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def default_loss(outputs: Any, targets: Optional[torch.Tensor]) -> torch.Tensor:
    """The model's own loss when its output has one, else ``F.cross_entropy(outputs, targets)``.

    Raises:
        TrainingError: the output has no loss and there are no targets, or it is no tensor to take
            cross-entropy of; the message says to pass ``loss_fn`` or the labels.
    """
    loss = own_loss(outputs)
    if loss is not None:
        return loss
    if targets is None:
        raise TrainingError(
            f"the model returned a {type(outputs).__name__} without a loss, and the batch has no targets: pass "
            "loss_fn=..., or give the model its labels among the inputs (Hugging Face models compute their own "
            "loss from labels=...)"
        )
    if not isinstance(outputs, torch.Tensor):
        raise TrainingError(
            f"the default loss is cross-entropy of the model's output tensor, but the model returned a "
            f"{type(outputs).__name__} without a loss: pass loss_fn=lambda outputs, targets: ..."
        )
    return F.cross_entropy(outputs, targets)
