"""``in_mode``: run a model in train or eval mode, then give each module its own mode back."""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

__all__ = ["in_mode"]


@contextlib.contextmanager
def in_mode(model: nn.Module, training: bool) -> Iterator[None]:
    """Run the block with ``model`` training or evaluating.

    Training: ``model.train()`` only when the model itself is in eval mode, so that a module the
    user set to eval inside a training model (a frozen BatchNorm, as in fine-tuning) stays frozen.
    Evaluating: every module in eval.  Afterwards ``model.train(its own mode)`` (so that an
    overridden ``train`` undoes what it did) and each module back in its own mode.  (Nothing is
    switched when nothing changes: ``model.train()`` costs 1-2 % of a small CNN's step.)
    """
    modules = list(model.modules())
    modes = [m.training for m in modules]
    switch = not model.training if training else any(modes)
    try:
        if switch:
            model.train(training)
        yield
    finally:
        if switch:
            model.train(modes[0])
            for m, mode in zip(modules, modes):
                if m.training != mode:
                    m.training = mode
