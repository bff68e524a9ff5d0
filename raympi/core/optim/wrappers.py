"""Wrappers around a whole optimizer: :func:`inject_hyperparams` and :func:`apply_if_finite`.

As optax's ``inject_hyperparams`` and ``apply_if_finite``: the first puts
the optimizer's hyperparameters (the learning rate a schedule gives now) in
its state, where :func:`current_hyperparams` finds them for logging and a
checkpoint keeps them; the second skips steps whose gradients are not
finite.  Both keep the inner optimizer's ``fused_apply`` through
:func:`~raympi.core.optim.apply_gradients`; their states
(:class:`~raympi.core.optim.states.InjectHyperparamsState`,
:class:`~raympi.core.optim.states.ApplyIfFiniteState`) are trees of tensors
(counters as 0-d CPU tensors).
"""

from __future__ import annotations

import inspect
import math
from collections import Counter
from typing import Any, Callable, Iterable

import torch

from raympi.core import pytree
from raympi.core.optim.base import (
    GradientTransformation,
    OptState,
    Params,
    Updates,
    apply_gradients,
    clone_tree,
    cross_rank_sum,
    new_count,
    shard_view,
)
from raympi.core.optim.states import ApplyIfFiniteState, InjectHyperparamsState, find_states

__all__ = ["inject_hyperparams", "current_hyperparams", "apply_if_finite"]

_ALWAYS_STATIC = frozenset({"mask"})  # adamw's: a callable, not a schedule


def _keywords(factory: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a call to ``factory`` as keywords (``**kwargs`` spread out)."""
    sig = inspect.signature(factory)
    out: dict[str, Any] = {}
    for name, value in sig.bind(*args, **kwargs).arguments.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL):
            raise TypeError(f"inject_hyperparams cannot pass {name!r} of {factory.__name__} by keyword")
        else:
            out[name] = value
    return out


def _injectable(value: Any) -> bool:
    """A number or a schedule; classes (``from_torch``'s optimizer) and bools are static."""
    if isinstance(value, bool):
        return False
    return isinstance(value, (int, float)) or (callable(value) and not isinstance(value, type))


def inject_hyperparams(
    factory: Callable[..., GradientTransformation], static_args: Iterable[str] = ()
) -> Callable[..., GradientTransformation]:
    """Make an optimizer factory keep its hyperparameters in the optimizer state.

    ``inject_hyperparams(factory)(**hparams)`` is ``factory(**hparams)`` whose
    state is :class:`~raympi.core.optim.states.InjectHyperparamsState`
    ``(count, hyperparams, inner_state)``, ``hyperparams`` a dict ``{name: 0-d tensor}``.
    The hyperparameters are the numbers and schedules among the arguments
    *given* (defaults are left alone), under the factory's own names
    (``lr`` for :func:`~raympi.core.optim.adam` and its kin).  Each step
    evaluates the schedules at this wrapper's count, builds ``factory`` with
    those values and steps it, and stores the values it used, so after step
    ``k`` (from 0) the state holds ``lr(k)``.  A plain number is read back
    from the state each step (as optax does), so overwriting it there changes
    it.  Read the values with :func:`current_hyperparams`.

    Args:
        factory: a function returning a :class:`GradientTransformation`, e.g.
            :func:`~raympi.core.optim.adamw` or :func:`~raympi.core.optim.from_torch`.
        static_args: names of number or callable arguments to pass as they
            are; callables other than schedules must be named here, except a
            ``mask`` (always static).

    Returns:
        A function with ``factory``'s arguments, returning the wrapped
        :class:`GradientTransformation` (with a ``fused_apply``).

    Example:
        >>> from raympi.core import optim
        >>> opt = inject_hyperparams(optim.adam)(lr=optim.cosine_decay(1e-3, 1000))
        >>> optim.current_hyperparams(opt.init({"w": torch.ones(2)}))
        {'lr': 0.001}
    """
    static_args = frozenset(static_args) | _ALWAYS_STATIC

    def wrapped(*args: Any, **kwargs: Any) -> GradientTransformation:
        given = _keywords(factory, args, kwargs)
        hyper = {n: v for n, v in given.items() if n not in static_args and _injectable(v)}
        static = {n: v for n, v in given.items() if n not in hyper}

        def values(state: OptState) -> dict[str, Any]:
            count = int(state.count)
            return {n: (float(v(count)) if callable(v) else state.hyperparams[n].item()) for n, v in hyper.items()}

        def as_tensors(vals: dict[str, Any]) -> dict[str, torch.Tensor]:
            # float64 on the CPU: reading one back gives the very Python float the schedule returned.
            return {
                n: torch.tensor(v, dtype=torch.int64 if isinstance(v, int) else torch.float64) for n, v in vals.items()
            }

        def init(params: Params) -> OptState:
            vals = {n: (float(v(0)) if callable(v) else v) for n, v in hyper.items()}
            return InjectHyperparamsState(new_count(), as_tensors(vals), factory(**static, **vals).init(params))

        def new_state(state: OptState, vals: dict[str, Any], inner_state: OptState) -> InjectHyperparamsState:
            return InjectHyperparamsState(state.count + 1, as_tensors(vals), inner_state)

        def update(grads: Updates, state: OptState, params: Params = None) -> tuple[Updates, OptState]:
            vals = values(state)
            updates, inner_state = factory(**static, **vals).update(grads, state.inner_state, params)
            return updates, new_state(state, vals, inner_state)

        def fused_apply(
            grads: Updates, state: OptState, params: Params, donate: bool = False
        ) -> tuple[Params, OptState]:
            vals = values(state)
            inner = factory(**static, **vals)
            new_params, inner_state = apply_gradients(inner, grads, state.inner_state, params, donate=donate)
            return new_params, new_state(state, vals, inner_state)

        return GradientTransformation(init, update, fused_apply)

    return wrapped


def current_hyperparams(opt_state: Any) -> dict[str, float]:
    """The hyperparameters of every :func:`inject_hyperparams` in an optimizer state tree.

    Args:
        opt_state: an optimizer state (e.g. ``TrainState.opt_state``).

    Returns:
        ``{name: value}``: the values used by the last step (before the
        first, those the first will use).  A name found in more than one
        place is qualified by its path in the state, e.g.
        ``"inner_states/head/lr"``.  Empty when nothing was injected.

    Example:
        >>> from raympi.core import optim
        >>> opt = optim.chain(optim.clip_by_global_norm(1.0), inject_hyperparams(optim.sgd)(0.1, momentum=0.9))
        >>> current_hyperparams(opt.init({"w": torch.ones(2)}))
        {'lr': 0.1, 'momentum': 0.9}
    """
    found = find_states(opt_state, InjectHyperparamsState)
    seen = Counter(name for _, state in found for name in state.hyperparams)
    out = {}
    for path, state in found:
        for name, value in state.hyperparams.items():
            out[name if seen[name] == 1 else "/".join((*path, name))] = float(value)
    return out


def _all_finite(grads: Any) -> bool:
    """Whether every gradient element is finite; one read back to the host."""
    g = [t for t in pytree.leaves(grads) if t.numel()]  # (a rank's slice may hold empty pieces)
    here = torch.tensor(True)
    if g:  # the max-norm is NaN or inf exactly when an element is (the 2-norm could overflow instead)
        ok = [torch.isfinite(n) for n in torch._foreach_norm(g, ord=math.inf)]
        here = torch.stack([x.to(ok[0].device) for x in ok]).all()
    if shard_view() is None:
        return bool(here)
    # This rank's slices only: the ranks agree, counting those that saw a non-finite element.
    return int(cross_rank_sum((~here).to(torch.float64).reshape(1))[0]) == 0


def apply_if_finite(inner: GradientTransformation, max_consecutive_errors: int = 5) -> GradientTransformation:
    """Skip the steps whose gradients hold a NaN or an inf, as optax's ``apply_if_finite``.

    A skipped step returns zero updates (the parameters stay as they are) and
    leaves ``inner``'s state untouched.  After ``max_consecutive_errors``
    skipped steps in a row, the next non-finite step is applied anyway, so a
    run that keeps diverging fails visibly instead of idling.  Deciding
    reads one value back to the host each step.  State:
    :class:`~raympi.core.optim.states.ApplyIfFiniteState` ``(notfinite_count,
    last_finite, total_notfinite, inner_state)`` (consecutive skips, whether
    the last step was finite, all skips, ``inner``'s state).

    Args:
        inner: the optimizer to guard; put this wrapper outermost (or first
            in a :func:`chain`) so it sees the raw gradients.
        max_consecutive_errors: how many non-finite steps in a row to skip.

    Returns:
        A :class:`GradientTransformation` with a ``fused_apply``.

    Example:
        >>> from raympi.core import optim
        >>> opt = apply_if_finite(optim.adamw(1e-3), max_consecutive_errors=10)
    """
    if max_consecutive_errors < 0:
        raise ValueError(f"max_consecutive_errors must be >= 0, got {max_consecutive_errors}")

    def init(params: Params) -> OptState:
        return ApplyIfFiniteState(new_count(), torch.tensor(True), new_count(), inner.init(params))

    def check(grads: Updates, state: OptState) -> tuple[bool, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Whether to apply this step, and the new ``(notfinite_count, last_finite, total_notfinite)``."""
        finite = _all_finite(grads)
        streak = 0 if finite else int(state.notfinite_count) + 1
        counters = (
            torch.tensor(streak, dtype=torch.int64),
            torch.tensor(finite),
            state.total_notfinite + (0 if finite else 1),
        )
        return finite or streak > max_consecutive_errors, counters

    def update(grads: Updates, state: OptState, params: Params = None) -> tuple[Updates, OptState]:
        apply, counters = check(grads, state)
        if apply:
            updates, inner_state = inner.update(grads, state.inner_state, params)
        else:  # a copy: the caller may donate the new state while keeping the old one
            updates, inner_state = pytree.map(torch.zeros_like, grads), clone_tree(state.inner_state)
        return updates, ApplyIfFiniteState(*counters, inner_state)

    def fused_apply(grads: Updates, state: OptState, params: Params, donate: bool = False) -> tuple[Params, OptState]:
        apply, counters = check(grads, state)
        if apply:
            new_params, inner_state = apply_gradients(inner, grads, state.inner_state, params, donate=donate)
        elif donate:
            new_params, inner_state = params, state.inner_state
        else:
            new_params, inner_state = clone_tree(params), clone_tree(state.inner_state)
        return new_params, ApplyIfFiniteState(*counters, inner_state)

    return GradientTransformation(init, update, fused_apply)
