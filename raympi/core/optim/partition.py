"""Per-parameter optimizers: :func:`masked`, :func:`multi_transform` and :func:`set_to_zero`.

Wrappers that run a transformation on some of the parameters only (as
optax's ``masked`` and ``multi_transform``): no weight decay on biases and
norms, a larger learning rate for a head, frozen layers.  Parameters are a
flat dict name -> tensor (``TrainState.params``); which parameter goes where
is static, decided by a dict or a callable evaluated on the parameters, and
lives in the closure, never in the state, so states stay trees of tensors
(:class:`~raympi.core.optim.states.MaskedState`,
:class:`~raympi.core.optim.states.MultiTransformState`).  Each group runs
through :func:`~raympi.core.optim.apply_gradients` on its own sub-dict, so an
inner optimizer with a ``fused_apply`` keeps its fast path and ``donate``
still writes in place.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

import torch

from raympi.core import pytree
from raympi.core.optim.base import GradientTransformation, OptState, Params, Updates, apply_gradients, per_param
from raympi.core.optim.states import EmptyState, MaskedState, MultiTransformState

__all__ = ["masked", "multi_transform", "set_to_zero"]

Mask = Union[Mapping[str, bool], Callable[[dict[str, Any]], Mapping[str, bool]]]
Labels = Union[Mapping[str, str], Callable[[dict[str, Any]], Mapping[str, str]]]


def _identity() -> GradientTransformation:
    """Updates pass through unchanged: the part of a :func:`masked` tree its inner transformation skips."""
    return GradientTransformation(lambda params: EmptyState(), lambda grads, state, params=None: (grads, state))


def _groups(
    labels: Any, tree: dict[str, Any], transforms: Mapping[Any, GradientTransformation], what: str
) -> dict[Any, list[str]]:
    """``{label: [names]}`` for every label of ``transforms``, in the order of ``tree``."""
    of = per_param(labels, tree, what)
    groups: dict[Any, list[str]] = {label: [] for label in transforms}
    for name in tree:
        if of[name] not in groups:
            raise ValueError(
                f"{what}: parameter {name!r} has label {of[name]!r}, which has no transformation "
                f"(labels: {sorted(map(str, transforms))})"
            )
        groups[of[name]].append(name)
    return groups


def _pick(tree: dict[str, Any], names: list[str]) -> dict[str, Any]:
    return {n: tree[n] for n in names}


def _init_groups(
    transforms: Mapping[Any, GradientTransformation], labels: Any, params: Params, what: str
) -> dict[Any, OptState]:
    groups = _groups(labels, params, transforms, what)
    return {label: transforms[label].init(_pick(params, names)) for label, names in groups.items()}


def _step_groups(
    transforms: Mapping[Any, GradientTransformation],
    labels: Any,
    what: str,
    grads: Updates,
    states: Mapping[Any, OptState],
    params: Params,
    donate: Optional[bool] = None,
) -> tuple[dict[str, Any], dict[Any, OptState]]:
    """Each group's step on its sub-dicts.

    Returns updates (``donate=None``) or, through ``apply_gradients``, new parameters; and the new states.
    """
    groups = _groups(labels, grads if params is None else params, transforms, what)
    out, new_states = {}, {}
    for label, names in groups.items():
        if not names:  # an empty group keeps its state (the foreach kernels refuse empty lists)
            new_states[label] = states[label]
            continue
        sub_g, sub_p = _pick(grads, names), None if params is None else _pick(params, names)
        if donate is None:
            res, new_states[label] = transforms[label].update(sub_g, states[label], sub_p)
        else:
            res, new_states[label] = apply_gradients(transforms[label], sub_g, states[label], sub_p, donate=donate)
        out.update(res)
    return {n: out[n] for n in grads}, new_states  # the parameters' order, so the tree's spec is kept


def masked(inner: GradientTransformation, mask: Mask) -> GradientTransformation:
    """Run ``inner`` on the parameters ``mask`` selects; the others' updates pass through it unchanged.

    As optax's ``masked``: a deselected parameter gets no contribution from
    ``inner`` (its incoming update is returned as is), so in a :func:`chain`
    the rest of the chain still trains it.  To freeze parameters use
    :func:`multi_transform` with :func:`set_to_zero`.  ``inner`` sees (and
    keeps state for) the selected sub-dict only.  State:
    :class:`~raympi.core.optim.states.MaskedState` ``(inner_state)``.

    Args:
        inner: the transformation to restrict.
        mask: a dict name -> bool, or a callable ``params -> dict`` (called
            with the parameters, or the gradients when ``update`` gets no
            parameters); it must name every parameter.

    Returns:
        A :class:`GradientTransformation` with a ``fused_apply`` (``inner``'s
        own on the selected parameters where it has one).

    Example:
        >>> from raympi.core import optim
        >>> decay = lambda params: {n: p.ndim >= 2 for n, p in params.items()}  # not biases and norms
        >>> opt = optim.chain(optim.scale_by_adam(), masked(optim.add_decayed_weights(0.1), decay),
        ...                   optim.scale_by_learning_rate(1e-3))
    """
    transforms = {True: inner, False: _identity()}

    def to_label(tree: Params) -> dict[str, bool]:
        return {n: bool(v) for n, v in per_param(mask, tree, "masked's mask").items()}

    def states(state: OptState) -> dict[bool, OptState]:
        return {True: state.inner_state, False: EmptyState()}

    def init(params: Params) -> OptState:
        return MaskedState(_init_groups(transforms, to_label, params, "masked")[True])

    def update(grads: Updates, state: OptState, params: Params = None) -> tuple[Updates, OptState]:
        updates, new = _step_groups(transforms, to_label, "masked", grads, states(state), params)
        return updates, MaskedState(new[True])

    def fused_apply(grads: Updates, state: OptState, params: Params, donate: bool = False) -> tuple[Params, OptState]:
        new_params, new = _step_groups(transforms, to_label, "masked", grads, states(state), params, donate)
        return new_params, MaskedState(new[True])

    return GradientTransformation(init, update, fused_apply)


def multi_transform(transforms: Mapping[str, GradientTransformation], labels: Labels) -> GradientTransformation:
    """Update each parameter with the transformation of its label.

    As optax's ``multi_transform``: every parameter has one label; each
    transformation sees (and keeps state for) its own sub-dict of parameters.
    State: :class:`~raympi.core.optim.states.MultiTransformState`
    ``(inner_states)``, ``inner_states`` a dict ``{label: state}``.

    Args:
        transforms: label (a string) -> transformation; :func:`set_to_zero`
            freezes the parameters of its label.
        labels: a dict name -> label, or a callable ``params -> dict`` (called
            with the parameters, or the gradients when ``update`` gets no
            parameters); it must label every parameter.

    Returns:
        A :class:`GradientTransformation` with a ``fused_apply`` (each
        group's own where it has one).

    Example:
        >>> from raympi.core import optim
        >>> label = lambda params: {n: "head" if n.startswith("head.") else "body" for n in params}
        >>> opt = multi_transform({"body": optim.adam(1e-4), "head": optim.adam(1e-3)}, label)
        >>> frozen_body = multi_transform({"body": set_to_zero(), "head": optim.adam(1e-3)}, label)
    """
    if not transforms:
        raise ValueError("multi_transform needs at least one transformation")
    bad = [label for label in transforms if not isinstance(label, str)]
    if bad:  # state keys: strings load back with torch.load(weights_only=True) everywhere
        raise TypeError(f"multi_transform's labels must be strings, got {bad}")
    transforms = dict(transforms)

    def init(params: Params) -> OptState:
        return MultiTransformState(_init_groups(transforms, labels, params, "multi_transform"))

    def update(grads: Updates, state: OptState, params: Params = None) -> tuple[Updates, OptState]:
        updates, new = _step_groups(transforms, labels, "multi_transform", grads, state.inner_states, params)
        return updates, MultiTransformState(new)

    def fused_apply(grads: Updates, state: OptState, params: Params, donate: bool = False) -> tuple[Params, OptState]:
        inner = state.inner_states
        new_params, new = _step_groups(transforms, labels, "multi_transform", grads, inner, params, donate)
        return new_params, MultiTransformState(new)

    return GradientTransformation(init, update, fused_apply)


def set_to_zero() -> GradientTransformation:
    """Replace the updates by zeros: in :func:`multi_transform`, the parameters of its label stay frozen.

    Stateless (:class:`~raympi.core.optim.states.EmptyState`).

    Returns:
        A :class:`GradientTransformation`.

    Example:
        >>> from raympi.core import optim
        >>> opt = optim.multi_transform({"train": optim.sgd(0.1), "frozen": set_to_zero()},
        ...                             lambda p: {n: "frozen" if n.startswith("0.") else "train" for n in p})
    """

    def init(params: Params) -> OptState:
        return EmptyState()

    def update(grads: Updates, state: OptState, params: Params = None) -> tuple[Updates, OptState]:
        return pytree.map(torch.zeros_like, grads), state

    return GradientTransformation(init, update)
