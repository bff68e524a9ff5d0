"""Optimizer states: one small NamedTuple per transformation, found by type, saved as plain dicts.

As optax's: each transformation keeps a state of its own type
(``ScaleByAdamState(count, mu, nu)``), a :func:`~raympi.core.optim.chain`'s
state is a tuple of its parts', and a wrapper holds its inner optimizer's
state in the field ``inner_state`` (``inner_states``: a dict label -> state).
Code that looks into a state tree (``ema_params``, ``current_hyperparams``)
finds the parts by type with :func:`find_states`.  NamedTuples are pytree
nodes, so states flatten, map and broadcast like any tree; the classes live
here, at module level, so a tree's spec unpickles on every worker.

Saved, a state is plain: :func:`to_plain` renders each state as a dict of
its fields plus :data:`TYPE_KEY` naming its class, so a checkpoint holds only
dicts, tuples, tensors and strings (``torch.load(weights_only=True)`` reads it
without raympi), and :func:`from_plain` builds the NamedTuples back.
Checkpoints written before these types held the same dicts without
:data:`TYPE_KEY`; :func:`from_plain` recognises those by their keys, once, at
load.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

__all__ = [
    "EmptyState",
    "ScaleByScheduleState",
    "TraceState",
    "ScaleByAdamState",
    "EmaState",
    "FromTorchState",
    "MaskedState",
    "MultiTransformState",
    "InjectHyperparamsState",
    "ApplyIfFiniteState",
    "ShardedState",
    "STATE_TYPES",
    "TYPE_KEY",
    "find_states",
    "to_plain",
    "from_plain",
]


# A field ``count`` (optax's name, and the key old checkpoints hold) shadows ``tuple.count``; mypy flags
# each such field (``[assignment]``), hence its ignore.  Behaviour is unaffected: a state's ``count`` is its field.


class EmptyState(NamedTuple):
    """The state of a stateless transformation (``clip_by_global_norm``, ``add_decayed_weights``, ``set_to_zero``)."""


class ScaleByScheduleState(NamedTuple):
    """``scale_by_learning_rate``'s state, and ``sgd``'s without momentum."""

    count: torch.Tensor  # type: ignore[assignment]  # steps taken: step k (from 0) uses lr(k); a 0-d int64 CPU tensor


class TraceState(NamedTuple):
    """``sgd``'s state with momentum."""

    count: torch.Tensor  # type: ignore[assignment]  # steps taken
    trace: Any  # the momentum buffers, shaped like the parameters


class ScaleByAdamState(NamedTuple):
    """The state of ``adam``, ``adamw`` and ``scale_by_adam``."""

    count: torch.Tensor  # type: ignore[assignment]  # steps taken
    mu: Any  # first moments, shaped like the parameters
    nu: Any  # second moments


class EmaState(NamedTuple):
    """``ema``'s state; read the average with ``ema_params``."""

    count: torch.Tensor  # type: ignore[assignment]  # steps taken
    ema: Any  # the moving average of the parameters


class FromTorchState(NamedTuple):
    """``from_torch``'s state."""

    count: torch.Tensor  # type: ignore[assignment]  # steps taken
    state: dict[str, dict[str, Any]]  # the torch optimizer's per-parameter state, by parameter name


class MaskedState(NamedTuple):
    """``masked``'s state."""

    inner_state: Any  # the inner transformation's, over the selected parameters


class MultiTransformState(NamedTuple):
    """``multi_transform``'s state."""

    inner_states: dict[str, Any]  # label -> that transformation's state


class InjectHyperparamsState(NamedTuple):
    """``inject_hyperparams``'s state; read the values with ``current_hyperparams``."""

    count: torch.Tensor  # type: ignore[assignment]  # steps taken: schedules are evaluated at it
    hyperparams: dict[str, torch.Tensor]  # name -> the value the last step used, 0-d CPU tensors
    inner_state: Any  # the wrapped optimizer's


class ApplyIfFiniteState(NamedTuple):
    """``apply_if_finite``'s state."""

    notfinite_count: torch.Tensor  # non-finite steps skipped in a row
    last_finite: torch.Tensor  # whether the last step's gradients were finite (0-d bool)
    total_notfinite: torch.Tensor  # non-finite steps in all
    inner_state: Any  # the guarded optimizer's


class ShardedState(NamedTuple):
    """One rank's part of an optimizer state sharded over the ranks (``shard_optimizer=True``).

    ``inner_state`` is the optimizer's own state over this rank's slices of the parameters (see
    :mod:`raympi.core.shard`): per-parameter tensors are 1-D pieces, counters are whole.  ``buddy``,
    where kept, holds another rank's, updated by every step as that rank updates its own: a rank lost
    takes no slice with it.
    """

    inner_state: Any  # the optimizer's state over this rank's slices
    rank: torch.Tensor  # 0-d int64: whose slices
    world: torch.Tensor  # 0-d int64: over how many ranks the parameters are cut
    buddy: Any = ()  # ``(rank, its inner_state)``: a copy of another rank's slice; ``()`` where none is kept

    @property
    def copy(self) -> Any:
        """The copy of another rank's ``inner_state`` this rank keeps, or ``None``."""
        return self.buddy[1] if self.buddy else None

    @property
    def copy_rank(self) -> Optional[int]:
        """Whose ``inner_state`` :attr:`copy` is, or ``None``."""
        return int(self.buddy[0]) if self.buddy else None


STATE_TYPES: tuple[type[Any], ...] = (
    EmptyState,
    ScaleByScheduleState,
    TraceState,
    ScaleByAdamState,
    EmaState,
    FromTorchState,
    MaskedState,
    MultiTransformState,
    InjectHyperparamsState,
    ApplyIfFiniteState,
    ShardedState,
)
#: The key that names a state's class in its plain dict (:func:`to_plain`).
TYPE_KEY = "__type__"

_TYPES = frozenset(STATE_TYPES)
_BY_NAME = {cls.__name__: cls for cls in STATE_TYPES}
# Before the types existed a state was the dict of its fields: each class had its own set of keys.
_BY_KEYS = {frozenset(cls._fields): cls for cls in STATE_TYPES}
assert len(_BY_KEYS) == len(STATE_TYPES), (
    "two optimizer state types with the same fields: old checkpoints would be ambiguous"
)
_INNER, _INNERS = "inner_state", "inner_states"  # the fields that hold further states

# Let torch.load(weights_only=True) read a state saved as it is (torch.save(opt_state)), in a process that
# imported raympi.
torch.serialization.add_safe_globals(list(STATE_TYPES))


def find_states(tree: Any, cls: type, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """The states of type ``cls`` in an optimizer state tree, outermost first, with their paths.

    Args:
        tree: an optimizer state (e.g. ``TrainState.opt_state``).
        cls: the state type sought, e.g. :class:`EmaState`.
        path: the prefix of the paths returned (for the recursion).

    Returns:
        ``[(path, state)]``; a path names the fields, dict keys and tuple
        indices on the way, e.g. ``("inner_states", "head")``.

    Example:
        >>> find_states((EmptyState(), EmaState(torch.tensor(0), {})), EmaState)
        [(('1',), EmaState(count=tensor(0), ema={}))]
    """
    found: list[tuple[tuple[str, ...], Any]] = []
    if isinstance(tree, cls):
        found.append((path, tree))
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        items = list(zip(tree._fields, tree))
    elif isinstance(tree, dict):
        items = [(str(k), v) for k, v in tree.items()]
    elif isinstance(tree, (tuple, list)):
        items = [(str(i), v) for i, v in enumerate(tree)]
    else:
        return found
    for key, value in items:
        found.extend(find_states(value, cls, (*path, key)))
    return found


def to_plain(tree: Any) -> Any:
    """An optimizer state with each state type rendered as a dict of its fields plus :data:`TYPE_KEY`.

    The tensors are shared, not copied.

    Args:
        tree: an optimizer state.

    Returns:
        The same tree of dicts, tuples, lists, tensors and strings, which
        ``torch.load(weights_only=True)`` reads back anywhere.

    Example:
        >>> to_plain(ScaleByScheduleState(torch.tensor(3)))
        {'count': tensor(3), '__type__': 'ScaleByScheduleState'}
    """
    kind = type(tree)
    if kind in _TYPES:
        plain = {field: to_plain(value) for field, value in zip(tree._fields, tree)}
        plain[TYPE_KEY] = kind.__name__
        return plain
    if kind is dict:
        return {k: to_plain(v) for k, v in tree.items()}
    if kind in (tuple, list):
        return kind(to_plain(v) for v in tree)
    return tree


def from_plain(tree: Any) -> Any:
    """Undo :func:`to_plain`; a state saved before the state types existed is converted too.

    Such an old state holds no :data:`TYPE_KEY`: each dict where a state
    stands (the root, a chain's parts, a wrapper's ``inner_state`` /
    ``inner_states``) whose keys are exactly a state type's fields becomes
    that type; other dicts (a transformation of your own) stay as they are.

    Args:
        tree: a state from :func:`to_plain`, or as older raympi saved it.

    Returns:
        The optimizer state with its NamedTuples; the tensors are shared.

    Raises:
        ValueError: a state type this raympi does not know, or fields that do not fit it.

    Example:
        >>> from_plain({"count": torch.tensor(3), "__type__": "ScaleByScheduleState"})
        ScaleByScheduleState(count=tensor(3))
        >>> from_plain({"count": torch.tensor(3)})  # as saved before
        ScaleByScheduleState(count=tensor(3))
    """
    return _typed(tree) if _tagged(tree) else _legacy(tree)


def _tagged(tree: Any) -> bool:
    if isinstance(tree, dict):
        return TYPE_KEY in tree or any(_tagged(v) for v in tree.values())
    if isinstance(tree, (tuple, list)):
        return any(_tagged(v) for v in tree)
    return False


def _typed(tree: Any) -> Any:
    if isinstance(tree, dict) and TYPE_KEY in tree:
        name = tree[TYPE_KEY]
        cls = _BY_NAME.get(name)
        fields = {k: _typed(v) for k, v in tree.items() if k != TYPE_KEY}
        # (a field added later, with a default, may be missing from what an older raympi saved)
        if cls is None or not set(cls._fields) - set(cls._field_defaults) <= set(fields) <= set(cls._fields):
            raise ValueError(
                f"not an optimizer state of this raympi: {name!r} with fields {sorted(fields)} "
                f"(known: {sorted(_BY_NAME)}); was it saved by a newer version?"
            )
        return cls(**fields)
    if isinstance(tree, dict):
        return {k: _typed(v) for k, v in tree.items()}
    if type(tree) in (tuple, list):
        return type(tree)(_typed(v) for v in tree)
    return tree


def _legacy(state: Any) -> Any:
    """A state position of an old (untagged) state: a chain's tuple, a state dict, or something else kept."""
    if type(state) in (tuple, list):
        return type(state)(_legacy(s) for s in state)
    if not isinstance(state, dict):
        return state
    cls = _BY_KEYS.get(frozenset(state))
    if cls is None:
        return state
    fields = dict(state)
    if _INNER in fields:
        fields[_INNER] = _legacy(fields[_INNER])
    if _INNERS in fields:
        fields[_INNERS] = {label: _legacy(s) for label, s in fields[_INNERS].items()}
    return cls(**fields)
