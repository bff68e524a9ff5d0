"""The optimizer interface: :class:`GradientTransformation` and the functions that run one.

The base of ``raympi.core.optim`` (as optax's ``_src/base.py``): the
``(init, update, fused_apply)`` triple, the type aliases, :func:`apply_updates`,
:func:`apply_gradients` and :func:`chain`, plus the small helpers the
transformations of the sibling modules are built from (counters, learning
rates, argument checks).  Torch alone, no Ray or MPI.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, NamedTuple, Optional, Union

import torch

from raympi.core import pytree

__all__ = [
    "GradientTransformation",
    "Schedule",
    "ScalarOrSchedule",
    "Params",
    "Updates",
    "OptState",
    "FusedApply",
    "apply_updates",
    "apply_gradients",
    "chain",
    "new_count",
    "lr_at",
    "scaled",
    "check_nonneg",
    "check_betas",
    "per_param",
    "clone_tree",
    "from_fused",
    "ShardView",
    "shard_view",
    "sharded",
    "cross_rank_sum",
]

Params = Any  # a tree of tensors (raympi uses a flat dict name -> tensor)
Updates = Any  # a tree of the same structure as the parameters
OptState = Any  # a tree of state NamedTuples (raympi.core.optim.states), tuples, dicts and tensors
Schedule = Callable[[int], float]
ScalarOrSchedule = Union[float, Schedule]
#: ``fused_apply(grads, state, params, donate) -> (params, state)``: an optimizer's one-pass update (see
#: :func:`apply_gradients`).
FusedApply = Callable[[Updates, OptState, Params, bool], tuple[Params, OptState]]
Tensors = Union[list[torch.Tensor], tuple[torch.Tensor, ...]]  # what torch's _foreach ops take (they return tuples)


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
# Shared by the optimizers of alias, transform, partition and wrappers.


def new_count() -> torch.Tensor:
    """A fresh step counter: a 0-d int64 zero on the CPU.

    On the CPU on purpose: schedules and bias corrections read it as a Python
    number every step, which must not synchronise with a GPU.
    """
    return torch.zeros((), dtype=torch.int64)


def lr_at(lr: ScalarOrSchedule, count: torch.Tensor) -> float:
    """The learning rate of step ``count`` (from 0): ``lr(count)`` for a schedule, else ``lr``."""
    return float(lr(int(count))) if callable(lr) else float(lr)


def scaled(xs: list[torch.Tensor], factor: float, donate: bool) -> list[torch.Tensor]:
    """``xs * factor``: new tensors, or ``xs`` multiplied in place when the caller donated them."""
    if donate:
        torch._foreach_mul_(xs, factor)
        return xs
    return list(torch._foreach_mul(xs, factor))


def check_nonneg(name: str, value: Any) -> None:
    """Refuse a negative hyperparameter (a schedule passes).

    Raises:
        ValueError: ``value < 0``, naming ``name``.
    """
    if not callable(value) and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def check_betas(b1: float, b2: float) -> None:
    """Refuse Adam decay rates outside [0, 1).

    Raises:
        ValueError: either lies outside.
    """
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise ValueError(f"betas must lie in [0, 1), got {(b1, b2)}")


class ShardView(NamedTuple):
    """What a transformation updating one rank's slices of the parameters needs of the whole.

    Attributes:
        full: every parameter as a ``meta`` tensor of its full shape and dtype (no memory): what
            per-parameter masks and labels are evaluated on, never the 1-D slices.
        sum_: sums a small tensor over the ranks in place and returns it (a global norm, a verdict).
    """

    full: dict[str, torch.Tensor]
    sum_: Callable[[torch.Tensor], torch.Tensor]


_SHARD: contextvars.ContextVar[Optional[ShardView]] = contextvars.ContextVar("raympi_shard", default=None)


def shard_view() -> Optional[ShardView]:
    """The :class:`ShardView` of the update running now, or ``None`` when it sees whole parameters."""
    return _SHARD.get()


@contextlib.contextmanager
def sharded(view: ShardView) -> Iterator[None]:
    """Run an optimizer's ``init`` / ``update`` on this rank's slices, with ``view`` of the whole."""
    token = _SHARD.set(view)
    try:
        yield
    finally:
        _SHARD.reset(token)


def cross_rank_sum(value: torch.Tensor) -> torch.Tensor:
    """``value`` summed over the ranks whose slices make the parameters (itself when unsharded)."""
    view = _SHARD.get()
    return value if view is None else view.sum_(value)


def per_param(spec: Any, params: Params, what: str) -> dict[Any, Any]:
    """A per-parameter setting evaluated for the flat dict ``params``.

    A callable ``spec`` sees the whole parameters: under :func:`sharded` (one rank's 1-D slices),
    their full-shape ``meta`` stand-ins, so ``p.ndim >= 2`` means the same on every rank.

    Args:
        spec: a dict name -> value, or a callable ``params -> dict``.
        params: the parameters (or gradients), a flat dict name -> tensor.
        what: the setting's name, for the error messages.

    Returns:
        The dict name -> value (it may hold more names than ``params``).

    Raises:
        TypeError: ``params`` is not a dict.  ValueError: a parameter has no entry.
    """
    if not isinstance(params, dict):
        raise TypeError(f"{what} needs params as a flat dict name -> tensor, got {type(params).__name__}")
    view = _SHARD.get()
    values: dict[Any, Any] = spec(params if view is None else view.full) if callable(spec) else spec
    missing = [n for n in params if n not in values]
    if missing:
        raise ValueError(f"{what} has no entry for parameter(s) {missing}")
    return values


def clone_tree(tree: Any) -> Any:
    """A copy of ``tree`` with every tensor leaf cloned (so a later donation cannot reach the original)."""
    return pytree.map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def from_fused(init: Callable[[Params], OptState], fused: FusedApply) -> GradientTransformation:
    """A transformation defined by its fused form; its ``update`` returns ``new - params``.

    Args:
        init: ``init(params) -> state``.
        fused: ``(grads, state, params, donate) -> (new_params, new_state)``.

    Returns:
        The :class:`GradientTransformation` ``(init, update, fused)``.
    """

    def update(grads: Updates, state: OptState, params: Params = None) -> tuple[Updates, OptState]:
        if params is None:
            raise ValueError("this optimizer needs params: call update(grads, state, params)")
        new, state = fused(grads, state, params, False)
        p, spec = pytree.flatten(params)
        return pytree.unflatten(list(torch._foreach_sub(pytree.leaves(new), p)), spec), state

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
    p, spec = pytree.flatten(params)
    return pytree.unflatten(list(torch._foreach_add(p, pytree.leaves(updates))), spec)


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
        >>> from raympi.core import optim
        >>> opt = optim.sgd(0.1)
        >>> p = {"w": torch.ones(2)}
        >>> apply_gradients(opt, {"w": torch.ones(2)}, opt.init(p), p)[0]
        {'w': tensor([0.9000, 0.9000])}
    """
    if optimizer.fused_apply is not None:
        return optimizer.fused_apply(grads, state, params, donate)
    updates, state = optimizer.update(grads, state, params)
    if donate:
        p = pytree.leaves(params)
        torch._foreach_add_(p, pytree.leaves(updates))
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
        >>> from raympi.core import optim
        >>> opt = chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1, momentum=0.9))
    """
    if not transforms:
        raise ValueError("chain needs at least one transformation")

    def init(params: Params) -> OptState:
        return tuple(t.init(params) for t in transforms)

    def update(grads: Updates, state: OptState, params: Params = None) -> tuple[Updates, OptState]:
        new_state = []
        for t, s in zip(transforms, state):
            grads, s = t.update(grads, s, params)
            new_state.append(s)
        return grads, tuple(new_state)

    def fused_apply(grads: Updates, state: OptState, params: Params, donate: bool = False) -> tuple[Params, OptState]:
        new_state = []
        for t, s in zip(transforms[:-1], state):
            grads, s = t.update(grads, s, params)
            new_state.append(s)
        new_params, s = apply_gradients(transforms[-1], grads, state[-1], params, donate=donate)
        return new_params, tuple(new_state + [s])

    return GradientTransformation(init, update, fused_apply)
