"""Trees of tensors: the one wrapper around ``torch.utils._pytree``.

``torch.utils._pytree`` is private API; the rest of raympi goes through these
few names only, so a change upstream is mended here once.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils import _pytree as _pt

TreeSpec = _pt.TreeSpec

__all__ = [
    "TreeSpec",
    "flatten",
    "unflatten",
    "map",
    "leaves",
    "dict_keys_of_leaves",
    "tensor_leaves",
    "register_dataclass",
    "to_arrays",
    "from_arrays",
]


def flatten(tree: Any) -> tuple[list[Any], TreeSpec]:
    """Split ``tree`` into its leaves and a spec that rebuilds it."""
    return _pt.tree_flatten(tree)


def unflatten(leaves: list[Any], spec: TreeSpec) -> Any:
    """Rebuild a tree from ``leaves`` and the ``spec`` of :func:`flatten`."""
    return _pt.tree_unflatten(leaves, spec)


def leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree``, in flatten order."""
    return _pt.tree_leaves(tree)


def dict_keys_of_leaves(tree: Any) -> list[tuple[Any, ...]]:
    """For each leaf of ``tree`` in flatten order, the keys of the dicts on its path, outermost first."""
    pairs, _ = _pt.tree_flatten_with_path(tree)
    return [tuple(k.key for k in path if isinstance(k, _pt.MappingKey)) for path, _ in pairs]


def map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:  # noqa: A001 - mirrors jax.tree.map
    """Apply ``fn`` leaf-wise over ``tree`` (and trees of the same shape in ``rest``)."""
    return _pt.tree_map(fn, tree, *rest)


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensor leaves of ``tree``; other leaves are skipped."""
    return [x for x in _pt.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def to_arrays(tree: Any) -> Any:
    """CPU tensors as numpy arrays sharing their memory (numpy-less dtypes such as bfloat16 stay tensors).

    Ray moves numpy arrays zero-copy (out-of-band pickle 5 buffers, read in place from the object
    store), while a pickled tensor goes through ``torch.save`` into bytes and is copied again on load.
    """
    return map(
        lambda x: (
            x.detach().numpy() if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dtype in _NUMPY else x
        ),
        tree,
    )


def from_arrays(tree: Any) -> Any:
    """Undo :func:`to_arrays`: numpy arrays as tensors sharing their (possibly read-only) memory."""
    import numpy as np
    import warnings

    with warnings.catch_warnings():  # the object store's arrays are read-only: callers copy before writing
        warnings.simplefilter("ignore", UserWarning)
        return map(lambda x: torch.from_numpy(x) if isinstance(x, np.ndarray) else x, tree)


_NUMPY = {
    torch.float64,
    torch.float32,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
}


def register_dataclass(cls: type, field_names: list[str]) -> type:
    """Register a dataclass whose ``field_names`` are its children."""
    _pt.register_pytree_node(
        cls,
        lambda obj: ([getattr(obj, f) for f in field_names], None),
        lambda children, _ctx: cls(**dict(zip(field_names, children))),
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
    )
    return cls
