"""Gradient transformations that are building blocks rather than whole optimizers.

Put in front of an optimizer with :func:`~raympi.core.optim.chain` (as
optax's ``_src/transform.py``): they rewrite the gradient tree and keep their
own small state.  Today that is :func:`clip_by_global_norm`.
"""

from __future__ import annotations

import torch

from raympi.core import pytree
from raympi.core.optim.base import GradientTransformation

__all__ = ["clip_by_global_norm"]


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale the gradients so that their global L2 norm is at most ``max_norm``.

    Same rule as ``torch.nn.utils.clip_grad_norm_``: multiply by
    ``min(1, max_norm / (norm + 1e-6))``.  The factor stays a tensor, so no
    value is read back to the host.  Stateless (its state is ``{}``).

    Args:
        max_norm: the largest global norm let through.

    Returns:
        A :class:`GradientTransformation`; put it first in a :func:`chain`.

    Example:
        >>> from raympi.core import optim
        >>> opt = optim.chain(clip_by_global_norm(1.0), optim.adam(1e-3))
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")

    def init(params):
        return {}

    def update(grads, state, params=None):
        g, spec = pytree.flatten(grads)
        if not g:
            return grads, state
        norms = torch._foreach_norm(g)
        total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return pytree.unflatten(list(torch._foreach_mul(g, coef)), spec), state

    return GradientTransformation(init, update)
