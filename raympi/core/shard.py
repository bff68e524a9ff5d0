"""Sharded optimizer state (ZeRO-2): each rank keeps and updates only its slice of the parameters.

The trainable parameters, in the state's order, are read as one flat vector of ``T`` elements, cut
into ``N`` chunks of ``c = ceil(T / N)`` elements: rank ``r`` owns ``[r*c, min((r+1)*c, T))`` (the
last chunks may be shorter, or empty).  Equal chunks let gloo and NCCL (which need them) work on a
buffer padded to ``c*N``; MPI sends the exact counts.  A step then

1. reduce-scatters the gradients: each rank receives the sum over the ranks of its own chunk only;
2. runs the optimizer on that chunk, cut back into per-parameter *pieces* (a dict name -> 1-D
   tensor for every parameter, empty where a parameter lies outside the chunk), under
   :func:`raympi.core.optim.sharded`: masks and labels are evaluated on the full shapes, the global
   norm and the finiteness verdict are summed over the ranks;
3. all-gathers the new chunks into new whole parameters.

The state keeps whole parameters on every rank; ``opt_state`` is a :class:`ShardedState` holding the
optimizer's state over this rank's pieces, the same tree structure as an unsharded state with 1-D
pieces in place of per-parameter tensors.  :func:`gather_opt_state` and :func:`split_opt_state` turn
one into the other, so resharding ``N -> M`` is a pure function of the layout.

Nothing is written in place before the all-gather is complete: a step abandoned between the two
collectives leaves the state as it was.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Protocol, Sequence

import torch

from raympi.core import pytree
from raympi.core.optim import GradientTransformation, ShardView, apply_gradients, sharded
from raympi.core.optim.states import ShardedState
from raympi.core.state import TrainState
from raympi.exceptions import ConfigError, TrainingError

__all__ = [
    "ShardSync",
    "ShardLayout",
    "init_opt_state",
    "split_opt_state",
    "gather_opt_state",
    "reduce_gradients",
    "apply_sharded",
    "gather_params",
    "shard_state",
    "join_states",
    "ShardBuffers",
    "check_shardable",
]


class ShardSync(Protocol):
    """The collectives a sharded step needs (the MPI communicator and the gloo/NCCL process groups have them)."""

    rank: int
    size: int

    def reduce_scatter(self, flat: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Sum ``flat`` (padded to ``max(counts) * size`` elements, and free to overwrite) over the ranks;
        return this rank's chunk (it may be a view of ``flat``)."""
        ...

    def all_gather_(self, flat: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Fill ``flat`` (padded as above) in place with every rank's chunk, each from its own rank."""
        ...

    def sum_(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a small tensor over the ranks, in place; return it."""
        ...


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """How the flat parameters are cut over ``world`` ranks (see the module docstring)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    world: int

    @classmethod
    def of(cls, params: dict[str, torch.Tensor], world: int) -> ShardLayout:
        """The layout of ``params`` (a flat dict, in its order) over ``world`` ranks."""
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        return cls(tuple(params), tuple(tuple(p.shape) for p in params.values()), world)

    @property
    def numels(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    @property
    def total(self) -> int:
        return sum(self.numels)

    @property
    def chunk(self) -> int:
        """Elements per rank: the buffers are padded to ``chunk * world``."""
        return max(1, -(-self.total // self.world))

    def bounds(self, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s chunk ``[lo, hi)`` of the flat parameters."""
        return min(rank * self.chunk, self.total), min((rank + 1) * self.chunk, self.total)

    def counts(self) -> list[int]:
        """Every rank's chunk length (the last ones may be shorter, or 0)."""
        return [hi - lo for lo, hi in map(self.bounds, range(self.world))]

    def pieces(self, rank: int) -> dict[str, tuple[int, int]]:
        """name -> ``(start, stop)`` of the part of that parameter (flattened) in rank ``rank``'s chunk."""
        lo, hi = self.bounds(rank)
        out, offset = {}, 0
        for name, n in zip(self.names, self.numels):
            start, stop = max(lo - offset, 0), min(hi - offset, n)
            out[name] = (start, stop) if start < stop else (0, 0)
            offset += n
        return out


def _cut(tensors: dict[str, torch.Tensor], layout: ShardLayout, rank: int) -> dict[str, torch.Tensor]:
    """Views of this rank's pieces of whole tensors shaped like the parameters."""
    return {n: tensors[n].reshape(-1)[a:b] for n, (a, b) in layout.pieces(rank).items()}


def _full_view(params: dict[str, torch.Tensor], sum_: Any) -> ShardView:
    meta = {n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in params.items()}
    return ShardView(meta, sum_)


def _alone(value: torch.Tensor) -> torch.Tensor:
    """The cross-rank sum where there is one rank (initialisation, tests in one process)."""
    return value


def init_opt_state(
    optimizer: GradientTransformation, params: dict[str, torch.Tensor], layout: ShardLayout, rank: int
) -> ShardedState:
    """Rank ``rank``'s :class:`ShardedState`, initialised on its pieces only (no whole state is ever built).

    Raises:
        ConfigError: the optimizer cannot be sharded (``from_torch``).
    """
    with sharded(_full_view(params, _alone)):
        inner = optimizer.init({n: t.clone() for n, t in _cut(params, layout, rank).items()})
    return ShardedState(inner, torch.tensor(rank), torch.tensor(layout.world))


def _per_param(keys: tuple[Any, ...], layout: ShardLayout) -> Optional[str]:
    """The parameter a state leaf belongs to: the innermost dict key on its path that names one."""
    names = set(layout.names)
    return next((k for k in reversed(keys) if isinstance(k, str) and k in names), None)


def split_opt_state(full: Any, layout: ShardLayout, rank: int) -> ShardedState:
    """Rank ``rank``'s part of an unsharded optimizer state ``full`` (its per-parameter tensors cut into pieces)."""
    shapes = dict(zip(layout.names, layout.shapes))
    pieces = layout.pieces(rank)
    leaves, spec = pytree.flatten(full)
    out = []
    for keys, leaf in zip(pytree.dict_keys_of_leaves(full), leaves):
        name = _per_param(keys, layout)
        if name is not None and isinstance(leaf, torch.Tensor) and tuple(leaf.shape) == shapes[name]:
            a, b = pieces[name]
            leaf = leaf.reshape(-1)[a:b].clone()
        out.append(leaf)
    return ShardedState(pytree.unflatten(out, spec), torch.tensor(rank), torch.tensor(layout.world))


def gather_opt_state(parts: Sequence[ShardedState], layout: ShardLayout) -> Any:
    """The whole optimizer state from every rank's :class:`ShardedState`, in rank order.

    Per-parameter pieces are joined and reshaped; the other leaves (counters, hyperparameters) are
    the same on every rank and taken from rank 0's.

    Raises:
        ValueError: ``parts`` is not one state per rank of ``layout``, in rank order.
    """
    got = [(int(p.rank), int(p.world)) for p in parts]
    if got != [(r, layout.world) for r in range(layout.world)]:
        raise ValueError(f"gather_opt_state needs the {layout.world} ranks' states in rank order, got {got}")
    shapes = dict(zip(layout.names, layout.shapes))
    cuts = [layout.pieces(r) for r in range(layout.world)]
    flat = [pytree.flatten(p.inner_state)[0] for p in parts]
    first, spec = pytree.flatten(parts[0].inner_state)
    out = []
    for i, keys in enumerate(pytree.dict_keys_of_leaves(parts[0].inner_state)):
        name, leaf = _per_param(keys, layout), first[i]
        if name is not None and all(
            isinstance(f[i], torch.Tensor) and f[i].ndim == 1 and f[i].numel() == c[name][1] - c[name][0]
            for f, c in zip(flat, cuts)
        ):
            leaf = torch.cat([f[i].to(first[i].device) for f in flat]).reshape(shapes[name])
        out.append(leaf)
    return pytree.unflatten(out, spec)


def shard_state(
    state: TrainState, rank: int, world: int, optimizer: Optional[GradientTransformation] = None
) -> TrainState:
    """Rank ``rank``'s sharded copy of ``state``: its optimizer state cut into this rank's pieces.

    ``optimizer`` (with a fresh state, step 0) initialises the pieces directly instead, so that no rank
    ever holds the whole optimizer state.  A state already sharded over ``world`` for ``rank`` is returned as is.

    Raises:
        TrainingError: ``state`` is sharded over another world size (join the ranks' states first).
    """
    layout = ShardLayout.of(state.params, world)
    current = state.opt_state
    if isinstance(current, ShardedState):
        if (int(current.rank), int(current.world)) == (rank, world):
            return state
        raise TrainingError(
            f"this state holds rank {int(current.rank)}'s slice of {int(current.world)}: join every rank's "
            "state first (raympi.core.shard.join_states) and shard the whole"
        )
    sharded_state = (
        init_opt_state(optimizer, state.params, layout, rank)
        if optimizer is not None
        else split_opt_state(current, layout, rank)
    )
    return state.replace(opt_state=sharded_state)


def join_states(parts: Sequence[TrainState]) -> TrainState:
    """The whole state from every rank's sharded state, in rank order (rank 0's parameters and buffers); a
    state that is whole already (a world of one keeps it so) is returned as it is."""
    if not isinstance(parts[0].opt_state, ShardedState):
        return parts[0]
    layout = ShardLayout.of(parts[0].params, len(parts))
    return parts[0].replace(opt_state=gather_opt_state([p.opt_state for p in parts], layout))


class ShardBuffers:
    """The memory a sharded step writes into again, for a caller that donates its states
    (``make_train_step(donate=True)``, as the workers do): no fresh allocation per step (on the CPU,
    page faults), while nothing the current state holds is written before the step commits.

    Two flat buffers of the parameters' size take turns: the current parameters are views of one; the
    step packs the gradients into the other (``free``), reduce-scatters them there, writes its new chunk
    there and all-gathers the new parameters into it.  Once it commits, the input state's buffer is the
    free one (the caller dropped that state).  The optimizer slice likewise: the step copies the current
    one into the slice of the state before last and updates that in place.
    """

    def __init__(self) -> None:
        self.free: Optional[torch.Tensor] = None  # a flat buffer nothing live holds
        self.last: Optional[tuple[torch.Tensor, list[Any]]] = None  # the last output: (flat params, state leaves)
        self.spare_state: Optional[list[Any]] = None  # the state before last's slice: free to write
        self.grad_chunk: Optional[torch.Tensor] = None  # the summed gradient chunk, out of ``free``'s way

    def flat(self, layout: ShardLayout, like: torch.Tensor) -> torch.Tensor:
        """The free flat buffer (made where there is none of this size)."""
        size, buf = layout.chunk * layout.world, self.free
        if buf is None or buf.numel() != size or buf.dtype != like.dtype or buf.device != like.device:
            self.free = buf = torch.zeros(size, dtype=like.dtype, device=like.device)
        return buf

    def chunk_copy(self, pieces: dict[str, torch.Tensor]) -> torch.Tensor:
        """The gradient pieces joined into a buffer of their own (they may lie where the new parameters go)."""
        size, like, buf = sum(p.numel() for p in pieces.values()), next(iter(pieces.values())), self.grad_chunk
        if buf is None or buf.numel() != size or buf.dtype != like.dtype or buf.device != like.device:
            self.grad_chunk = buf = torch.empty(size, dtype=like.dtype, device=like.device)
        return _joined(pieces, buf)

    def input_is_last(self, params: dict[str, torch.Tensor], inner: Any) -> bool:
        """Whether ``params`` and ``inner`` are the last output (then the caller donated them to this step)."""
        last, leaves = self.last, pytree.leaves(inner)
        return (
            last is not None
            and next(iter(params.values())).data_ptr() == last[0].data_ptr()
            and len(leaves) == len(last[1])
            and all(x is y for x, y in zip(leaves, last[1]))
        )

    def committed(self, flat: torch.Tensor, inner: Any, donated: Optional[tuple[torch.Tensor, list[Any]]]) -> None:
        """The step's output lives in ``flat`` and ``inner``; ``donated``: the input's buffers, now free."""
        self.free, self.spare_state = (donated[0], donated[1]) if donated is not None else (None, None)
        self.last = (flat, pytree.leaves(inner))


def _flat(tensors: list[torch.Tensor], layout: ShardLayout, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The tensors flattened into one buffer padded to ``chunk * world`` (``out``, or a new one)."""
    if out is None:
        out = torch.zeros(layout.chunk * layout.world, dtype=tensors[0].dtype, device=tensors[0].device)
    torch.cat([t.reshape(-1) for t in tensors], out=out[: layout.total])
    return out


def reduce_gradients(
    grads: dict[str, torch.Tensor],
    layout: ShardLayout,
    sync: Optional[ShardSync],
    buffers: Optional[ShardBuffers] = None,
) -> dict[str, torch.Tensor]:
    """This rank's pieces of the gradients summed over the ranks (a reduce-scatter)."""
    rank = 0 if sync is None else sync.rank
    if sync is None:  # one rank: its sums are its own gradients (new tensors of the step's)
        return _cut(grads, layout, rank)
    g = list(grads.values())
    flat = _flat(g, layout, buffers.flat(layout, g[0]) if buffers is not None else None)
    chunk = sync.reduce_scatter(flat, layout.counts())
    lo, _ = layout.bounds(rank)
    offset, out = 0, {}
    for name, n, (a, b) in zip(layout.names, layout.numels, layout.pieces(rank).values()):
        out[name] = chunk[offset + a - lo : offset + b - lo] if b > a else chunk[:0]
        offset += n
    return out


def apply_sharded(
    optimizer: GradientTransformation,
    grads: dict[str, torch.Tensor],
    opt_state: Any,
    params: dict[str, torch.Tensor],
    sync: Optional[ShardSync],
    buffers: Optional[ShardBuffers] = None,
) -> tuple[dict[str, torch.Tensor], ShardedState]:
    """One optimizer step on this rank's pieces, then the all-gather of the new parameters.

    Nothing the inputs hold is written.  With ``buffers`` (a caller that drops its old states), the
    step writes into the buffers of the state before last instead of new ones.

    Args:
        optimizer: the optimizer, as unsharded.
        grads: this rank's pieces of the summed gradients (:func:`reduce_gradients`).
        opt_state: this rank's :class:`ShardedState`, or an unsharded state (cut here on the first step).
        params: the whole parameters (not written).
        sync: the collectives; ``None`` in a world of one.
        buffers: the step's :class:`ShardBuffers`, or ``None`` (new tensors every step).

    Returns:
        ``(new whole parameters, new ShardedState)``; the inputs are left as they were.

    Raises:
        TrainingError: ``opt_state`` was sharded over another world size or for another rank.
    """
    rank, world = (0, 1) if sync is None else (sync.rank, sync.size)
    layout = ShardLayout.of(params, world)
    if not isinstance(opt_state, ShardedState):
        opt_state = split_opt_state(opt_state, layout, rank)
    if (int(opt_state.rank), int(opt_state.world)) != (rank, world):
        raise TrainingError(
            f"the optimizer state is rank {int(opt_state.rank)}'s of {int(opt_state.world)} but this is rank {rank} "
            f"of {world}: gather it first (raympi.core.shard.gather_opt_state) and split it for this world"
        )
    view = _full_view(params, _alone if sync is None else sync.sum_)
    if buffers is None:
        with sharded(view):
            new_pieces, inner = apply_gradients(optimizer, grads, opt_state.inner_state, _cut(params, layout, rank))
        return gather_params(new_pieces, layout, sync), ShardedState(inner, opt_state.rank, opt_state.world)
    donated = buffers.input_is_last(params, opt_state.inner_state)
    grads = _cut_like(grads, buffers.chunk_copy(grads))
    flat = buffers.flat(layout, next(iter(params.values())))
    lo, hi = layout.bounds(rank)
    _joined(_cut(params, layout, rank), flat[lo:hi])
    pieces = _cut(_views(flat, layout), layout, rank)
    state = opt_state.inner_state
    if donated and buffers.spare_state is not None:  # the state before last's slice takes the current one
        torch._foreach_copy_(buffers.spare_state, pytree.leaves(state))
        state = pytree.unflatten(buffers.spare_state, pytree.flatten(state)[1])
    with sharded(view):
        new_pieces, inner = apply_gradients(optimizer, grads, state, pieces, donate=state is not opt_state.inner_state)
    for name, piece in pieces.items():  # a transformation may hand back new tensors instead of writing in place
        if new_pieces[name].data_ptr() != piece.data_ptr():
            piece.copy_(new_pieces[name])
    out = gather_params(pieces, layout, sync, into=flat)
    buffers.committed(flat, inner, (_flat_of(params), pytree.leaves(opt_state.inner_state)) if donated else None)
    return out, ShardedState(inner, opt_state.rank, opt_state.world)


def _joined(pieces: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """The pieces one after another, flat, written into ``out`` (one rank's chunk)."""
    return torch.cat([p.reshape(-1) for p in pieces.values()], out=out)


def _cut_like(pieces: dict[str, torch.Tensor], flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of ``flat`` shaped like ``pieces`` (laid one after another)."""
    out, offset = {}, 0
    for name, p in pieces.items():
        out[name] = flat[offset : offset + p.numel()].view(p.shape)
        offset += p.numel()
    return out


def _views(flat: torch.Tensor, layout: ShardLayout) -> dict[str, torch.Tensor]:
    """The parameters as views of the flat buffer ``flat``."""
    out, offset = {}, 0
    for name, shape, n in zip(layout.names, layout.shapes, layout.numels):
        out[name] = flat[offset : offset + n].view(shape)
        offset += n
    return out


def _flat_of(params: dict[str, torch.Tensor]) -> torch.Tensor:
    """The flat buffer a step's output parameters are views of."""
    base = next(iter(params.values()))._base
    assert base is not None and base.dim() == 1, "not a sharded step's output"
    return base


def gather_params(
    pieces: dict[str, torch.Tensor],
    layout: ShardLayout,
    sync: Optional[ShardSync],
    into: Optional[torch.Tensor] = None,
) -> dict[str, torch.Tensor]:
    """Whole tensors shaped like the parameters from every rank's pieces (an all-gather), as views of one
    flat buffer (``into``, whose own chunk already holds the pieces, or a new one); with ``sync`` ``None``
    (one rank) the pieces are the whole."""
    rank = 0 if sync is None else sync.rank
    flat = into
    if flat is None:
        first = next(iter(pieces.values()))
        flat = torch.empty(layout.chunk * layout.world, dtype=first.dtype, device=first.device)
        lo, hi = layout.bounds(rank)
        if hi > lo:
            torch.cat([p.reshape(-1) for p in pieces.values()], out=flat[lo:hi])
    if sync is not None:
        sync.all_gather_(flat, layout.counts())
    return _views(flat, layout)


def check_shardable(params: dict[str, torch.Tensor]) -> None:
    """Refuse parameters a flat buffer cannot hold: several dtypes or devices.

    Raises:
        ConfigError: naming the dtypes or devices found.
    """
    kinds = {(p.dtype, p.device) for p in params.values()}
    if len(kinds) > 1:
        raise ConfigError(
            f"shard_optimizer=True needs every trainable parameter in one dtype on one device (they are cut from "
            f"one flat buffer); found {sorted(map(str, kinds))}. Cast the model first (model.float()) or "
            "use shard_optimizer=False"
        )
