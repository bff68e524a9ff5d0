"""Optimizers as pure ``(init, update)`` pairs, in the manner of optax.

This is the update half of the functional core: ``train_step`` computes a
gradient tree and hands it to the optimizer, which returns new parameters
and a new optimizer state.  Nothing here touches Ray or MPI, and nothing
mutates its inputs unless told it may (``donate``): functions return new
tensors, so a ``TrainState`` can be reused, compared or checkpointed at any
point.

* An optimizer is a :class:`GradientTransformation`: ``init(params)`` returns
  the optimizer state; ``update(grads, state, params)`` returns
  ``(updates, new_state)``; updates are *added* to the parameters with
  :func:`apply_updates`, so a descent step carries the minus sign.
* :func:`apply_gradients` does update and apply in one go.  Where an
  optimizer has a ``fused_apply`` (``sgd``, ``adam``, ``adamw``,
  ``from_torch``, and a ``chain`` ending in one) it computes the new
  parameters straight away: two fewer passes over memory, and the very
  arithmetic of its ``torch.optim`` twin.  ``train_step`` uses it.
* ``donate=True`` (as JAX's buffer donation) lets ``apply_gradients`` write
  the new parameters and optimizer state into the old ones' memory, for a
  caller that drops the old state anyway: no second copy of the parameters
  and optimizer state, and no fresh allocations (which on the CPU cost page
  faults every step).  The default never mutates anything.
* Optimizer states are plain ``dict`` / ``tuple`` trees of tensors (no custom
  classes), so they go through ``torch.save`` / ``torch.load(weights_only=True)``
  and ``torch.utils._pytree`` unchanged.  Step counters are 0-d int64 tensors
  kept on the CPU: reading them for a schedule never waits on an accelerator.
* The arithmetic runs on whole lists of tensors with torch's multi-tensor
  ``torch._foreach_*`` kernels, as ``torch.optim`` does with ``foreach=True``.
* A learning rate is a float or a *schedule*: a callable ``count -> lr``
  (:func:`constant`, :func:`cosine_decay`, :func:`linear_warmup`); step ``k``
  (from 0) uses ``lr(k)``.
* :func:`from_torch` wraps any ``torch.optim.Optimizer`` class for the cases
  the native optimizers do not cover.

Example:
    >>> import torch
    >>> from raympi import optim
    >>> opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3))
    >>> params = {"w": torch.ones(3)}
    >>> state = opt.init(params)
    >>> params, state = optim.apply_gradients(opt, {"w": torch.ones(3)}, state, params)
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional, Union

import torch

from raympi import _tree

__all__ = [
    "GradientTransformation",
    "Schedule",
    "ScalarOrSchedule",
    "apply_updates",
    "apply_gradients",
    "chain",
    "sgd",
    "adam",
    "adamw",
    "clip_by_global_norm",
    "from_torch",
    "constant",
    "cosine_decay",
    "linear_warmup",
]

Params = Any  # a tree of tensors (raympi uses a flat dict name -> tensor)
Updates = Any  # a tree of the same structure as the parameters
OptState = Any  # a tree of dicts / tuples / tensors
Schedule = Callable[[int], float]
ScalarOrSchedule = Union[float, Schedule]
FusedApply = Callable[[Updates, OptState, Params, bool], tuple[Params, OptState]]


class GradientTransformation(NamedTuple):
    """A pure optimizer.

    Attributes:
        init: ``init(params) -> state``.
        update: ``update(grads, state, params=None) -> (updates, new_state)``.
        fused_apply: optional ``(grads, state, params, donate) -> (new_params,
            new_state)``, equal to ``update`` followed by :func:`apply_updates`
            up to rounding, but computed straight into the new parameters; with
            ``donate`` it may overwrite ``params`` and ``state`` (never
            ``grads``).  Use it through :func:`apply_gradients`.
    """

    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Updates, OptState]]
    fused_apply: Optional[FusedApply] = None


# --------------------------------------------------------------------------- helpers


def _new_count() -> torch.Tensor:
    # On the CPU on purpose: schedules and bias corrections read it as a Python
    # number every step, which must not synchronise with a GPU.
    return torch.zeros((), dtype=torch.int64)


def _lr_at(lr: ScalarOrSchedule, count: torch.Tensor) -> float:
    return float(lr(int(count))) if callable(lr) else float(lr)


def _scale(xs: list[torch.Tensor], factor: float, donate: bool) -> list[torch.Tensor]:
    """``xs * factor``, in place when the caller donated ``xs``."""
    if donate:
        torch._foreach_mul_(xs, factor)
        return xs
    return list(torch._foreach_mul(xs, factor))


def _check_nonneg(name: str, value: Any) -> None:
    if not callable(value) and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def _from_fused(init: Callable[[Params], OptState], fused: FusedApply) -> GradientTransformation:
    """A transformation defined by its fused form; ``update`` returns ``new - params``."""

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("this optimizer needs params: call update(grads, state, params)")
        new, state = fused(grads, state, params, False)
        p, spec = _tree.flatten(params)
        return _tree.unflatten(list(torch._foreach_sub(_tree.leaves(new), p)), spec), state

    return GradientTransformation(init, update, fused)


def apply_updates(params: Params, updates: Updates) -> Params:
    """Add ``updates`` to ``params`` leaf-wise and return new tensors.

    Args:
        params: the parameter tree.
        updates: a tree of the same structure, from ``optimizer.update``.

    Returns:
        A new parameter tree; ``params`` is left untouched.

    Example:
        >>> apply_updates({"w": torch.ones(2)}, {"w": torch.full((2,), -0.5)})
        {'w': tensor([0.5000, 0.5000])}
    """
    p, spec = _tree.flatten(params)
    return _tree.unflatten(list(torch._foreach_add(p, _tree.leaves(updates))), spec)


def apply_gradients(
    optimizer: GradientTransformation,
    grads: Updates,
    state: OptState,
    params: Params,
    *,
    donate: bool = False,
) -> tuple[Params, OptState]:
    """One optimizer step: new parameters and new optimizer state.

    Uses ``optimizer.fused_apply`` when there is one, else ``update`` then
    :func:`apply_updates`.

    Args:
        optimizer: the :class:`GradientTransformation`.
        grads: the gradient tree, shaped like ``params``.
        state: the optimizer state, from ``init`` or a previous step.
        params: the current parameters.
        donate: allow writing the results into the memory of ``params`` and
            ``state``, which the caller must then no longer use.

    Returns:
        ``(new_params, new_state)``; without ``donate`` the inputs are left untouched.

    Example:
        >>> opt = sgd(0.1)
        >>> p = {"w": torch.ones(2)}
        >>> apply_gradients(opt, {"w": torch.ones(2)}, opt.init(p), p)[0]
        {'w': tensor([0.9000, 0.9000])}
    """
    if optimizer.fused_apply is not None:
        return optimizer.fused_apply(grads, state, params, donate)
    updates, state = optimizer.update(grads, state, params)
    if donate:
        p = _tree.leaves(params)
        torch._foreach_add_(p, _tree.leaves(updates))
        return params, state
    return apply_updates(params, updates), state


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` one after another; the state is a tuple of theirs.

    The chain's ``fused_apply`` runs the last transformation fused, so
    ``chain(clip_by_global_norm(1.0), adam(1e-3))`` keeps Adam's fast path.

    Args:
        *transforms: gradient transformations, applied left to right.

    Returns:
        One :class:`GradientTransformation`.

    Example:
        >>> opt = chain(clip_by_global_norm(1.0), sgd(0.1, momentum=0.9))
    """
    if not transforms:
        raise ValueError("chain needs at least one transformation")

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(grads, state, params=None):
        new_state = []
        for t, s in zip(transforms, state):
            grads, s = t.update(grads, s, params)
            new_state.append(s)
        return grads, tuple(new_state)

    def fused_apply(grads, state, params, donate=False):
        new_state = []
        for t, s in zip(transforms[:-1], state):
            grads, s = t.update(grads, s, params)
            new_state.append(s)
        new_params, s = apply_gradients(transforms[-1], grads, state[-1], params, donate=donate)
        return new_params, tuple(new_state + [s])

    return GradientTransformation(init, update, fused_apply)


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
        >>> opt = chain(clip_by_global_norm(1.0), adam(1e-3))
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")

    def init(params):
        return {}

    def update(grads, state, params=None):
        g, spec = _tree.flatten(grads)
        if not g:
            return grads, state
        norms = torch._foreach_norm(g)
        total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return _tree.unflatten(list(torch._foreach_mul(g, coef)), spec), state

    return GradientTransformation(init, update)


# --------------------------------------------------------------------------- optimizers
# Each mirrors its torch.optim twin (foreach implementation) operation for
# operation: the roundings of a step compound over a long run (AdamW's
# ``1 - lr * wd``, rounded to float32, shrinks every weight every step), so
# "the same formula" is not enough to stay together for hundreds of steps.


def sgd(
    lr: ScalarOrSchedule,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """Stochastic gradient descent, matching ``torch.optim.SGD`` (dampening 0).

    State: ``{"count"}``, plus ``{"trace"}`` (the momentum buffers) with momentum.

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
    _check_nonneg("lr", lr)
    _check_nonneg("momentum", momentum)
    _check_nonneg("weight_decay", weight_decay)
    if nesterov and momentum == 0:
        raise ValueError("nesterov=True needs momentum > 0")

    def init(params):
        state = {"count": _new_count()}
        if momentum:
            # Zeros make the first step buf = g, exactly torch's lazily made buffer.
            state["trace"] = _tree.map(torch.zeros_like, params)
        return state

    def fused_apply(grads, state, params, donate=False):
        g, spec = _tree.flatten(grads)
        p = _tree.leaves(params)
        value = _lr_at(lr, state["count"])
        new_state = {"count": state["count"] + 1}
        if weight_decay:
            g = torch._foreach_add(g, p, alpha=weight_decay)
        if momentum:
            buf = _scale(_tree.leaves(state["trace"]), momentum, donate)
            torch._foreach_add_(buf, g)  # buf is fresh or donated: in place is safe
            new_state["trace"] = _tree.unflatten(buf, spec)
            g = torch._foreach_add(g, buf, alpha=momentum) if nesterov else buf
        if donate:
            torch._foreach_add_(p, g, alpha=-value)
            return params, new_state
        return _tree.unflatten(list(torch._foreach_add(p, g, alpha=-value)), spec), new_state

    return _from_fused(init, fused_apply)


def _adam(
    lr: ScalarOrSchedule, betas: tuple[float, float], eps: float, weight_decay: float, decoupled: bool
) -> GradientTransformation:
    """Adam (L2 weight decay) or AdamW (decoupled), as ``torch.optim.Adam``. State ``{"count", "mu", "nu"}``."""
    b1, b2 = betas
    _check_nonneg("lr", lr)
    _check_nonneg("weight_decay", weight_decay)
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise ValueError(f"betas must lie in [0, 1), got {betas}")

    def init(params):
        return {
            "count": _new_count(),
            "mu": _tree.map(torch.zeros_like, params),
            "nu": _tree.map(torch.zeros_like, params),
        }

    def fused_apply(grads, state, params, donate=False):
        g, spec = _tree.flatten(grads)
        p = _tree.leaves(params)
        value = _lr_at(lr, state["count"])
        count = state["count"] + 1
        t = int(count)
        if weight_decay and not decoupled:
            g = torch._foreach_add(g, p, alpha=weight_decay)
        mu, nu = _tree.leaves(state["mu"]), _tree.leaves(state["nu"])
        if donate:
            torch._foreach_lerp_(mu, g, 1 - b1)
        else:
            mu = list(torch._foreach_lerp(mu, g, 1 - b1))
        nu = _scale(nu, b2, donate)
        torch._foreach_addcmul_(nu, g, g, value=1 - b2)  # nu is fresh or donated
        # Bias corrections as Python floats, as torch does when not capturable.
        bc1, bc2_sqrt = 1 - b1**t, (1 - b2**t) ** 0.5
        denom = torch._foreach_sqrt(nu)
        torch._foreach_div_(denom, bc2_sqrt)
        torch._foreach_add_(denom, eps)
        if weight_decay and decoupled:
            new = _scale(p, 1 - value * weight_decay, donate)
            torch._foreach_addcdiv_(new, mu, denom, value=-value / bc1)
        elif donate:
            new = p
            torch._foreach_addcdiv_(new, mu, denom, value=-value / bc1)
        else:
            new = list(torch._foreach_addcdiv(p, mu, denom, value=-value / bc1))
        new_state = {"count": count, "mu": _tree.unflatten(mu, spec), "nu": _tree.unflatten(nu, spec)}
        return _tree.unflatten(new, spec), new_state

    return _from_fused(init, fused_apply)


def adam(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """Adam, matching ``torch.optim.Adam`` (``weight_decay`` is L2 on the gradient).

    State: ``{"count", "mu", "nu"}``.

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
) -> GradientTransformation:
    """AdamW, matching ``torch.optim.AdamW``: decoupled decay ``p *= 1 - lr * wd``.

    State: ``{"count", "mu", "nu"}``.

    Args:
        lr: learning rate, a float or a schedule.
        betas: decay rates of the first and second moments.
        eps: added to the denominator for stability.
        weight_decay: decoupled decay coefficient (torch's default 1e-2).

    Returns:
        A :class:`GradientTransformation` with a ``fused_apply``.

    Example:
        >>> opt = adamw(1e-3, weight_decay=0.05)
    """
    return _adam(lr, betas, eps, weight_decay, decoupled=True)


# --------------------------------------------------------------------------- torch.optim bridge


def from_torch(optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any) -> GradientTransformation:
    """Wrap a ``torch.optim.Optimizer`` class as a pure :class:`GradientTransformation`.

    For optimizers raympi does not provide (RMSprop, Adagrad, your own).  Each
    step builds a throwaway optimizer over *copies* of the parameters, loads
    the state, sets ``.grad``, calls ``step()`` and returns the copies (or
    ``updates = new - old`` from ``update``) with the optimizer's new
    per-parameter state.  That keeps the surface pure at the price of copies
    and Python work per step: expect it to be slower than the native optimizers.  State: ``{"count", "state": {name: {...}}}``, where
    the per-parameter dicts are what the optimizer keeps in ``optimizer.state``
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

    def init(params):
        if not isinstance(params, dict):
            raise TypeError("from_torch needs params as a flat dict name -> tensor")
        return {"count": _new_count(), "state": {}}

    def fused_apply(grads, state, params, donate=False):
        # Always works on copies: donation would save little next to the rest.
        names = list(params)
        copies = [params[n].detach().clone() for n in names]
        ctor = dict(kwargs)
        if callable(lr):
            ctor["lr"] = _lr_at(lr, state["count"])
        opt = optimizer_cls(copies, **ctor)
        if state["state"]:
            sd = opt.state_dict()
            # Clone: load_state_dict keeps tensors that already match, and step()
            # would then write into the caller's state.
            sd["state"] = {
                i: _tree.map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, state["state"][n])
                for i, n in enumerate(names)
                if n in state["state"]
            }
            opt.load_state_dict(sd)
        for p, n in zip(copies, names):
            p.grad = grads[n].detach().clone()  # a copy: some optimizers write into .grad
        opt.step()
        new_state = {n: dict(opt.state[p]) for p, n in zip(copies, names) if opt.state[p]}
        return dict(zip(names, copies)), {"count": state["count"] + 1, "state": new_state}

    return _from_fused(init, fused_apply)


# --------------------------------------------------------------------------- schedules


def constant(value: float) -> Schedule:
    """A schedule that always returns ``value``.

    Example:
        >>> constant(0.1)(1000)
        0.1
    """
    return lambda count: value


def cosine_decay(init_value: float, decay_steps: int, alpha: float = 0.0) -> Schedule:
    """Cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps``.

    Args:
        init_value: the value at step 0.
        decay_steps: steps until the floor is reached; it stays there after.
        alpha: the floor, as a fraction of ``init_value``.

    Returns:
        A schedule ``count -> lr``.

    Example:
        >>> round(cosine_decay(1.0, 100)(50), 6)
        0.5
    """
    if decay_steps <= 0:
        raise ValueError(f"decay_steps must be > 0, got {decay_steps}")

    def schedule(count: int) -> float:
        frac = min(count, decay_steps) / decay_steps
        return init_value * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * frac)) + alpha)

    return schedule


def linear_warmup(
    warmup_steps: int, schedule: ScalarOrSchedule, init_value: float = 0.0
) -> Schedule:
    """Ramp linearly from ``init_value`` to ``schedule``'s start, then follow it.

    Step ``k < warmup_steps`` gives ``init + (peak - init) * k / warmup_steps``
    with ``peak = schedule(0)``; after that, ``schedule(k - warmup_steps)``.

    Args:
        warmup_steps: length of the ramp.
        schedule: a float or the schedule that follows the ramp.
        init_value: the value at step 0.

    Returns:
        A schedule ``count -> lr``.

    Example:
        >>> lr = linear_warmup(100, cosine_decay(1e-3, 900))
        >>> lr(50), lr(100)
        (0.0005, 0.001)
    """
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    after = schedule if callable(schedule) else constant(float(schedule))

    def warm(count: int) -> float:
        if count < warmup_steps:
            peak = after(0)
            return init_value + (peak - init_value) * count / warmup_steps
        return after(count - warmup_steps)

    return warm
