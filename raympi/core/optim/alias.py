"""The optimizers: :func:`sgd`, :func:`adam`, :func:`adamw` and the :func:`from_torch` bridge.

Whole optimizers ready to pass to ``make_train_step`` (as optax's
``_src/alias.py``), each a :class:`~raympi.core.optim.GradientTransformation`
defined by its ``fused_apply``, which computes the new parameters straight
away with the arithmetic of its ``torch.optim`` twin.
"""

from __future__ import annotations

from typing import Any

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
    clone_tree,
    from_fused,
    lr_at,
    new_count,
    per_param,
    scaled,
    shard_view,
)
from raympi.core.optim.states import FromTorchState, ScaleByAdamState, ScaleByScheduleState, TraceState
from raympi.core.optim.transform import adam_init, adam_moments
from raympi.exceptions import ConfigError

__all__ = ["sgd", "adam", "adamw", "from_torch"]

# Each mirrors its torch.optim twin (foreach implementation) operation for
# operation: the roundings of a step compound over a long run (AdamW's
# ``1 - lr * wd``, rounded to float32, shrinks every weight every step), so
# "the same formula" is not enough to stay together for hundreds of steps.


def _fused_inputs(
    grads: Updates, params: Params, lr: ScalarOrSchedule, count: torch.Tensor, l2: float
) -> tuple[Tensors, Any, list[torch.Tensor], float, torch.Tensor]:
    """What a fused step starts from: the gradients' leaves (``l2``: L2 weight decay added, fresh
    tensors), their tree spec, the parameters' leaves, this step's learning rate and the next count."""
    g: Tensors
    g, spec = pytree.flatten(grads)
    p = pytree.leaves(params)
    if l2:
        g = torch._foreach_add(g, p, alpha=l2)
    return g, spec, p, lr_at(lr, count), count + 1


def sgd(
    lr: ScalarOrSchedule,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """Stochastic gradient descent, matching ``torch.optim.SGD`` (dampening 0).

    State: :class:`~raympi.core.optim.states.ScaleByScheduleState` ``(count)``;
    with momentum :class:`~raympi.core.optim.states.TraceState` ``(count, trace)``
    (``trace``: the momentum buffers).

    Args:
        lr: learning rate, a float or a schedule.
        momentum: momentum factor (0: plain SGD).
        nesterov: Nesterov momentum.
        weight_decay: L2 penalty added to the gradient.

    Returns:
        A :class:`GradientTransformation` with a ``fused_apply``.

    Example:
        >>> opt = sgd(0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    """
    check_nonneg("lr", lr)
    check_nonneg("momentum", momentum)
    check_nonneg("weight_decay", weight_decay)
    if nesterov and momentum == 0:
        raise ValueError("nesterov=True needs momentum > 0")

    def init(params: Params) -> OptState:
        if momentum:
            # Zeros make the first step buf = g, exactly torch's lazily made buffer.
            return TraceState(new_count(), pytree.map(torch.zeros_like, params))
        return ScaleByScheduleState(new_count())

    def fused_apply(grads: Updates, state: OptState, params: Params, donate: bool = False) -> tuple[Params, OptState]:
        g, spec, p, value, count = _fused_inputs(grads, params, lr, state.count, l2=weight_decay)
        new_state: ScaleByScheduleState | TraceState = ScaleByScheduleState(count)
        if momentum:
            buf = scaled(pytree.leaves(state.trace), momentum, donate)
            torch._foreach_add_(buf, g)  # buf is fresh or donated: in place is safe
            new_state = TraceState(count, pytree.unflatten(buf, spec))
            g = torch._foreach_add(g, buf, alpha=momentum) if nesterov else buf
        if donate:
            torch._foreach_add_(p, g, alpha=-value)
            return params, new_state
        return pytree.unflatten(list(torch._foreach_add(p, g, alpha=-value)), spec), new_state

    return from_fused(init, fused_apply)


def _adam(
    lr: ScalarOrSchedule, betas: tuple[float, float], eps: float, weight_decay: float, decoupled: bool, mask: Any = None
) -> GradientTransformation:
    """Adam (L2 weight decay) or AdamW (decoupled, on the parameters ``mask`` picks), as ``torch.optim.Adam``.

    State :class:`~raympi.core.optim.states.ScaleByAdamState` ``(count, mu, nu)``.
    """
    b1, b2 = betas
    check_nonneg("lr", lr)
    check_nonneg("weight_decay", weight_decay)
    check_betas(b1, b2)

    def fused_apply(grads: Updates, state: OptState, params: Params, donate: bool = False) -> tuple[Params, OptState]:
        g, spec, p, value, count = _fused_inputs(grads, params, lr, state.count, l2=0.0 if decoupled else weight_decay)
        t = int(count)
        mu, nu, denom, bc1 = adam_moments(g, pytree.leaves(state.mu), pytree.leaves(state.nu), b1, b2, eps, t, donate)
        if weight_decay and decoupled and mask is not None:
            # torch.optim.AdamW with a weight_decay=0 group for the others: their ``p`` is not scaled at all.
            picked = per_param(mask, params, "adamw's mask")
            decayed = [i for i, n in enumerate(params) if picked[n]]
            new = list(p)
            if decayed:  # the foreach kernels refuse empty lists
                for i, q in zip(decayed, scaled([p[i] for i in decayed], 1 - value * weight_decay, donate)):
                    new[i] = q
            if donate:
                torch._foreach_addcdiv_(new, mu, denom, value=-value / bc1)
            else:  # some of ``new`` are still the caller's tensors
                new = list(torch._foreach_addcdiv(new, mu, denom, value=-value / bc1))
        elif weight_decay and decoupled:
            new = scaled(p, 1 - value * weight_decay, donate)
            torch._foreach_addcdiv_(new, mu, denom, value=-value / bc1)
        elif donate:
            new = p
            torch._foreach_addcdiv_(new, mu, denom, value=-value / bc1)
        else:
            new = list(torch._foreach_addcdiv(p, mu, denom, value=-value / bc1))
        new_state = ScaleByAdamState(count, pytree.unflatten(mu, spec), pytree.unflatten(nu, spec))
        return pytree.unflatten(new, spec), new_state

    return from_fused(adam_init, fused_apply)


def adam(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """Adam, matching ``torch.optim.Adam`` (``weight_decay`` is L2 on the gradient).

    State: :class:`~raympi.core.optim.states.ScaleByAdamState` ``(count, mu, nu)``.

    Args:
        lr: learning rate, a float or a schedule.
        betas: decay rates of the first and second moments.
        eps: added to the denominator for stability.
        weight_decay: L2 penalty added to the gradient.

    Returns:
        A :class:`GradientTransformation` with a ``fused_apply``.

    Example:
        >>> opt = adam(3e-4, betas=(0.9, 0.95))
    """
    return _adam(lr, betas, eps, weight_decay, decoupled=False)


def adamw(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    mask: Any = None,
) -> GradientTransformation:
    """AdamW, matching ``torch.optim.AdamW``: decoupled decay ``p *= 1 - lr * wd``.

    Arguments, state and return value as :func:`adam`, except that
    ``weight_decay`` (torch's default 1e-2) shrinks the parameters directly
    instead of being added to the gradient, and:

    Args:
        mask: which parameters are decayed: a dict name -> bool, or a callable
            ``params -> dict`` (params a flat dict); ``None`` decays all.  Equal
            to ``torch.optim.AdamW`` with a ``weight_decay=0`` group for the
            others, still fused.  The unfused spelling is
            ``chain(scale_by_adam(), masked(add_decayed_weights(wd), mask), scale_by_learning_rate(lr))``.

    Example:
        >>> opt = adamw(1e-3, weight_decay=0.05)
        >>> no_decay_on_biases_and_norms = adamw(1e-3, mask=lambda p: {n: t.ndim >= 2 for n, t in p.items()})
    """
    return _adam(lr, betas, eps, weight_decay, decoupled=True, mask=mask)


# --------------------------------------------------------------------------- torch.optim bridge


def from_torch(optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any) -> GradientTransformation:
    """Wrap a ``torch.optim.Optimizer`` class as a pure :class:`GradientTransformation`.

    For optimizers raympi does not provide (RMSprop, Adagrad, your own).  Each
    step builds a throwaway optimizer over *copies* of the parameters, loads
    the state, sets ``.grad``, calls ``step()`` and returns the copies (or
    ``updates = new - old`` from ``update``) with the optimizer's new
    per-parameter state.  That keeps the surface pure at the price of copies
    and Python work per step: expect it to be slower than the native
    optimizers.  State: :class:`~raympi.core.optim.states.FromTorchState`
    ``(count, state)``, ``state`` a dict ``{name: {...}}`` whose
    per-parameter dicts are what the optimizer keeps in ``optimizer.state``
    (empty until the first update, because torch creates them lazily).  An
    ``lr`` keyword may be a schedule.  Parameters must be a flat dict; one
    parameter group; no closures (so not LBFGS).

    Args:
        optimizer_cls: a ``torch.optim.Optimizer`` subclass.
        **kwargs: its constructor arguments, e.g. ``lr=0.01, alpha=0.9``.

    Returns:
        A :class:`GradientTransformation` with a ``fused_apply``.

    Example:
        >>> opt = from_torch(torch.optim.RMSprop, lr=1e-3, alpha=0.9)
    """
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"from_torch needs a torch.optim.Optimizer subclass, got {optimizer_cls!r}")
    lr = kwargs.get("lr")

    def init(params: Params) -> OptState:
        if shard_view() is not None:
            raise ConfigError(
                f"from_torch({optimizer_cls.__name__}) cannot be sharded (shard_optimizer=True): a torch.optim "
                "optimizer sees whole parameter tensors, and some (Adafactor's factored moments, LAMB's trust "
                "ratio) are not elementwise, so it cannot update 1-D slices. Use a native raympi.optim "
                "optimizer (sgd, adam, adamw, ...) or shard_optimizer=False"
            )
        if not isinstance(params, dict):
            raise TypeError("from_torch needs params as a flat dict name -> tensor")
        return FromTorchState(new_count(), {})

    def fused_apply(grads: Updates, state: OptState, params: Params, donate: bool = False) -> tuple[Params, OptState]:
        # Always works on copies: donation would save little next to the rest.
        names = list(params)
        copies = [params[n].detach().clone() for n in names]
        ctor = dict(kwargs)
        if callable(lr):
            ctor["lr"] = lr_at(lr, state.count)
        opt = optimizer_cls(copies, **ctor)
        if state.state:
            sd = opt.state_dict()
            # Clone: load_state_dict keeps tensors that already match, and step()
            # would then write into the caller's state.
            sd["state"] = {i: clone_tree(state.state[n]) for i, n in enumerate(names) if n in state.state}
            opt.load_state_dict(sd)
        for p, n in zip(copies, names):
            p.grad = grads[n].detach().clone()  # a copy: some optimizers write into .grad
        opt.step()
        new_state = {n: dict(opt.state[p]) for p, n in zip(copies, names) if opt.state[p]}
        return dict(zip(names, copies)), FromTorchState(state.count + 1, new_state)

    return from_fused(init, fused_apply)
