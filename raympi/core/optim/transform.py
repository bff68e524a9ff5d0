"""Gradient transformations that are building blocks rather than whole optimizers.

Combined with :func:`~raympi.core.optim.chain` (as optax's
``_src/transform.py``), each rewrites the update tree and keeps its own small
state.  :func:`clip_by_global_norm` goes in front of an optimizer;
:func:`scale_by_adam`, :func:`add_decayed_weights` and
:func:`scale_by_learning_rate` are the pieces of the Adam family of
:mod:`~raympi.core.optim.alias`, up to rounding::

    chain(scale_by_adam(), scale_by_learning_rate(lr))                           # adam(lr)
    chain(scale_by_adam(), add_decayed_weights(wd), scale_by_learning_rate(lr))  # adamw(lr, weight_decay=wd)

The aliases stay the faster way to run those two (fused, with donation);
the pieces are for building variants.  :func:`ema` goes last in a chain and
keeps a moving average of the parameters (:func:`ema_params` reads it).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from raympi.core import pytree
from raympi.core.optim.base import (
    GradientTransformation,
    OptState,
    Params,
    ScalarOrSchedule,
    Tensors,
    Updates,
    check_betas,
    check_nonneg,
    cross_rank_sum,
    lr_at,
    new_count,
    scaled,
    shard_view,
)
from raympi.core.optim.states import EmaState, EmptyState, ScaleByAdamState, ScaleByScheduleState, find_states

__all__ = [
    "clip_by_global_norm",
    "scale_by_adam",
    "add_decayed_weights",
    "scale_by_learning_rate",
    "ema",
    "ema_params",
    "adam_init",
    "adam_moments",
]


def adam_init(params: Params) -> ScaleByAdamState:
    """The state of Adam and its kin before the first step: count and moments zero.

    Args:
        params: the parameter tree.

    Returns:
        ``ScaleByAdamState(count, mu, nu)``, the moments shaped like ``params``.
    """
    return ScaleByAdamState(new_count(), pytree.map(torch.zeros_like, params), pytree.map(torch.zeros_like, params))


def adam_moments(
    g: Tensors,
    mu: list[torch.Tensor],
    nu: list[torch.Tensor],
    b1: float,
    b2: float,
    eps: float,
    t: int,
    donate: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor], tuple[torch.Tensor, ...], float]:
    """Adam's step ``t`` (from 1) as ``torch.optim.Adam`` computes it.

    ``denom = sqrt(nu) / sqrt(1 - b2**t) + eps``; the step is then
    ``(mu / denom) / (1 - b1**t)``.

    Args:
        g: the gradients; mu, nu: the moments before the step (updated in
            place when ``donate``, else copied).
        b1, b2, eps: Adam's hyperparameters.
        t: the step, from 1.
        donate: whether ``mu`` and ``nu`` may be overwritten.

    Returns:
        ``(mu, nu, denom, 1 - b1**t)``.
    """
    if donate:
        torch._foreach_lerp_(mu, g, 1 - b1)
    else:
        mu = list(torch._foreach_lerp(mu, g, 1 - b1))
    nu = scaled(nu, b2, donate)
    torch._foreach_addcmul_(nu, g, g, value=1 - b2)  # nu is fresh or donated
    # Bias corrections as Python floats, as torch does when not capturable.
    bc1, bc2_sqrt = 1 - b1**t, (1 - b2**t) ** 0.5
    denom = torch._foreach_sqrt(nu)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    return mu, nu, denom, bc1


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale the gradients so that their global L2 norm is at most ``max_norm``.

    Same rule as ``torch.nn.utils.clip_grad_norm_``: multiply by
    ``min(1, max_norm / (norm + 1e-6))``.  The factor stays a tensor, so no
    value is read back to the host.  Stateless (:class:`EmptyState`).

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

    def init(params: Params) -> OptState:
        return EmptyState()

    def update(grads: Updates, state: OptState, params: Params = None) -> tuple[Updates, OptState]:
        g, spec = pytree.flatten(grads)
        if not g:
            return grads, state
        norms = torch._foreach_norm(g)
        if shard_view() is None:
            total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
        else:  # this rank's slices: the squares summed over the ranks
            squares = torch.stack([n.to(norms[0].device, torch.float64) for n in norms]).square().sum()
            total = cross_rank_sum(squares.reshape(1))[0].sqrt().to(norms[0].dtype)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return pytree.unflatten(list(torch._foreach_mul(g, coef)), spec), state

    return GradientTransformation(init, update)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Rescale the gradients by Adam's moment estimates, without the learning rate.

    Updates ``m_hat / (sqrt(v_hat) + eps)``, with ``m_hat`` and ``v_hat`` the
    bias-corrected first and second moments, computed with the operations
    of ``torch.optim.Adam`` (and of :func:`~raympi.core.optim.adam`).
    Follow it with :func:`scale_by_learning_rate`.  State:
    :class:`ScaleByAdamState` ``(count, mu, nu)``, as :func:`~raympi.core.optim.adam`'s.

    Args:
        b1: decay rate of the first moment.
        b2: decay rate of the second moment.
        eps: added to the denominator for stability.

    Returns:
        A :class:`GradientTransformation` (no ``fused_apply``).

    Example:
        >>> from raympi.core import optim
        >>> opt = optim.chain(scale_by_adam(b2=0.95), optim.scale_by_learning_rate(3e-4))
    """
    check_betas(b1, b2)

    def update(grads: Updates, state: OptState, params: Params = None) -> tuple[Updates, OptState]:
        g, spec = pytree.flatten(grads)
        count = state.count + 1
        mu, nu, denom, bc1 = adam_moments(
            g, pytree.leaves(state.mu), pytree.leaves(state.nu), b1, b2, eps, int(count), False
        )
        updates = torch._foreach_div(mu, denom)
        torch._foreach_div_(updates, bc1)
        new_state = ScaleByAdamState(count, pytree.unflatten(mu, spec), pytree.unflatten(nu, spec))
        return pytree.unflatten(list(updates), spec), new_state

    return GradientTransformation(adam_init, update)


def add_decayed_weights(weight_decay: float) -> GradientTransformation:
    """Add ``weight_decay * params`` to the updates.

    Placed between :func:`scale_by_adam` and :func:`scale_by_learning_rate`
    it makes the step ``-lr * (adam + wd * p)``, i.e. AdamW's decoupled
    ``p *= 1 - lr * wd`` (:func:`~raympi.core.optim.adamw`); placed before
    :func:`scale_by_adam` it would be L2 on the gradient instead
    (:func:`~raympi.core.optim.adam` with ``weight_decay``).  Stateless (:class:`EmptyState`).
    Torch rounds ``1 - lr * wd`` to float32 every step and this chain does
    not, so the two drift apart by about 1e-8 (relative) per step; use
    :func:`~raympi.core.optim.adamw` for torch's exact arithmetic.

    Args:
        weight_decay: the factor, >= 0.

    Returns:
        A :class:`GradientTransformation`; its ``update`` needs ``params``.

    Example:
        >>> from raympi.core import optim
        >>> opt = optim.chain(optim.scale_by_adam(), add_decayed_weights(0.1), optim.scale_by_learning_rate(1e-3))
    """
    check_nonneg("weight_decay", weight_decay)

    def init(params: Params) -> OptState:
        return EmptyState()

    def update(grads: Updates, state: OptState, params: Params = None) -> tuple[Updates, OptState]:
        if params is None:
            raise ValueError("add_decayed_weights needs params: call update(grads, state, params)")
        if not weight_decay:
            return grads, state
        u, spec = pytree.flatten(grads)
        return pytree.unflatten(list(torch._foreach_add(u, pytree.leaves(params), alpha=weight_decay)), spec), state

    return GradientTransformation(init, update)


def scale_by_learning_rate(lr: ScalarOrSchedule) -> GradientTransformation:
    """Multiply the updates by ``-lr``: the descent step that ends a :func:`chain`.

    With a schedule, step ``k`` (from 0) uses ``lr(k)``, counted in this
    transformation's state :class:`ScaleByScheduleState` ``(count)`` (a CPU counter, as the aliases').

    Args:
        lr: learning rate, a float or a schedule.

    Returns:
        A :class:`GradientTransformation`.

    Example:
        >>> from raympi.core import optim
        >>> opt = optim.chain(optim.scale_by_adam(), scale_by_learning_rate(optim.cosine_decay(1e-3, 1000)))
    """
    check_nonneg("lr", lr)

    def init(params: Params) -> OptState:
        return ScaleByScheduleState(new_count())

    def update(grads: Updates, state: OptState, params: Params = None) -> tuple[Updates, OptState]:
        u, spec = pytree.flatten(grads)
        value = lr_at(lr, state.count)
        return pytree.unflatten(list(torch._foreach_mul(u, -value)), spec), ScaleByScheduleState(state.count + 1)

    return GradientTransformation(init, update)


def ema(decay: float, debias: bool = False) -> GradientTransformation:
    """Keep an exponential moving average of the *parameters* in the optimizer state.

    Unlike optax's ``ema`` (an average of the updates), this tracks the
    weights one evaluates with: put it last in a :func:`chain`, where it sees
    the final updates, and after each step it sets
    ``ema = decay * ema + (1 - decay) * (params + updates)``, returning the
    updates unchanged.  The average starts as a copy of the initial
    parameters; with ``debias`` it is instead the bias-corrected average of
    the parameters seen after each step (weight ``(1 - decay) / (1 - decay**t)``
    at step ``t``, so step 1 sets it to the new parameters).  An optimizer
    before it in the chain runs unfused (its ``update``).  State:
    :class:`EmaState` ``(count, ema)``; read the average with :func:`ema_params`.

    Args:
        decay: the weight of the old average, in [0, 1).
        debias: correct the average for its start instead of starting from
            the initial parameters.

    Returns:
        A :class:`GradientTransformation` with a ``fused_apply``; its
        ``update`` needs ``params``.

    Example:
        >>> from raympi.core import optim
        >>> opt = optim.chain(optim.adamw(1e-3), ema(0.999))
        >>> # after training: model weights = optim.ema_params(state.opt_state)
    """
    if not 0 <= decay < 1:
        raise ValueError(f"decay must lie in [0, 1), got {decay}")

    def init(params: Params) -> OptState:
        return EmaState(new_count(), pytree.map(lambda p: p.detach().clone(), params))

    def track(new: list[torch.Tensor], state: EmaState, donate: bool) -> EmaState:
        count = state.count + 1
        weight = (1 - decay) / (1 - decay ** int(count)) if debias else 1 - decay
        e, spec = pytree.flatten(state.ema)
        if donate:
            torch._foreach_lerp_(e, new, weight)
        else:
            e = list(torch._foreach_lerp(e, new, weight))
        return EmaState(count, pytree.unflatten(e, spec))

    def update(grads: Updates, state: OptState, params: Params = None) -> tuple[Updates, OptState]:
        if params is None:
            raise ValueError("ema needs params: call update(grads, state, params)")
        new = torch._foreach_add(pytree.leaves(params), pytree.leaves(grads))
        return grads, track(list(new), state, False)

    def fused_apply(grads: Updates, state: OptState, params: Params, donate: bool = False) -> tuple[Params, OptState]:
        p, spec = pytree.flatten(params)
        if donate:
            torch._foreach_add_(p, pytree.leaves(grads))
            return params, track(p, state, True)
        new = list(torch._foreach_add(p, pytree.leaves(grads)))
        return pytree.unflatten(new, spec), track(new, state, False)

    return GradientTransformation(init, update, fused_apply)


def ema_params(opt_state: Any) -> Optional[Any]:
    """The parameter average that :func:`ema` keeps, found anywhere in an optimizer state tree.

    Args:
        opt_state: an optimizer state (e.g. ``TrainState.opt_state``).

    Returns:
        The average, shaped like the parameters (the outermost :func:`ema`'s
        if there are several), or ``None`` when the state holds none.

    Example:
        >>> from raympi.core import optim
        >>> opt = optim.chain(optim.sgd(0.1), ema(0.9))
        >>> ema_params(opt.init({"w": torch.ones(2)}))
        {'w': tensor([1., 1.])}
    """
    found = find_states(opt_state, EmaState)
    return found[0][1].ema if found else None
