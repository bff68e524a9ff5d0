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

A *buddy* copy (``buddy=d``) keeps rank ``r + d``'s slice (mod ``N``) on rank ``r`` as well: 2/N of
the state instead of 1/N.  :func:`buddy_distance` picks ``d`` so that the copy lies on another node
where it can.  After the reduce-scatter each rank also receives its buddy's summed chunk
(:meth:`ShardSync.shift_`) and updates the copy as the buddy updates its own, replaying the cross-rank
sums of its own update (the global norm, the finiteness verdict): the copy stays bit-identical with no
more collectives.  Losing any one rank then loses no slice: :func:`plan_reshard`,
:func:`reshard_messages` and :func:`reshard_receive` move the surviving slices to a new world.

Nothing is written in place before the all-gather is complete: a step abandoned between the two
collectives leaves the state as it was.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional, Protocol, Sequence, cast

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
    "next_gradients",
    "buddy_distance",
    "Held",
    "SliceLost",
    "plan_reshard",
    "reshard_skeleton",
    "reshard_messages",
    "reshard_receive",
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

    def shift_(self, mine: torch.Tensor, counts: Sequence[int], by: int) -> torch.Tensor:
        """Send this rank's chunk ``mine`` to rank ``rank - by`` and return rank ``rank + by``'s (``counts[rank + by]``
        elements; ranks mod ``size``)."""
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

    # (computed once per layout: a step asks for them for every parameter)
    @functools.cached_property
    def numels(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    @functools.cached_property
    def total(self) -> int:
        return sum(self.numels)

    @property
    def chunk(self) -> int:
        """How many elements each rank's chunk holds (the buffers are padded to ``chunk * world``)."""
        return max(1, -(-self.total // self.world))

    def bounds(self, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s chunk ``[lo, hi)`` of the flat parameters."""
        return min(rank * self.chunk, self.total), min((rank + 1) * self.chunk, self.total)

    def counts(self) -> list[int]:
        """Every rank's chunk length (the last ones may be shorter, or 0)."""
        return [hi - lo for lo, hi in map(self.bounds, range(self.world))]

    def pieces(self, rank: int) -> dict[str, tuple[int, int]]:
        """name -> ``(start, stop)`` of the part of that parameter (flattened) in rank ``rank``'s chunk."""
        return _pieces(self, rank)


@functools.lru_cache(maxsize=64)
def _pieces(layout: ShardLayout, rank: int) -> dict[str, tuple[int, int]]:
    """:meth:`ShardLayout.pieces`, computed once per layout and rank (a step asks for them several times)."""
    lo, hi = layout.bounds(rank)
    out, offset = {}, 0
    for name, n in zip(layout.names, layout.numels):
        start, stop = max(lo - offset, 0), min(hi - offset, n)
        out[name] = (start, stop) if start < stop else (0, 0)
        offset += n
    return out


def _cut(tensors: dict[str, torch.Tensor], layout: ShardLayout, rank: int) -> dict[str, torch.Tensor]:
    """Views of this rank's pieces of whole tensors shaped like the parameters."""
    return {n: tensors[n].reshape(-1)[a:b] for n, (a, b) in layout.pieces(rank).items()}


def _full_view(params: dict[str, torch.Tensor], sum_: Any) -> ShardView:
    return ShardView(_meta(ShardLayout.of(params, 1), next(iter(params.values())).dtype), sum_)


@functools.lru_cache(maxsize=16)
def _meta(layout: ShardLayout, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Stand-ins of the parameters' full shapes, with no memory (what masks and labels are evaluated on)."""
    return {n: torch.empty(shape, dtype=dtype, device="meta") for n, shape in zip(layout.names, layout.shapes)}


def _alone(value: torch.Tensor) -> torch.Tensor:
    """The cross-rank sum where there is one rank (initialisation, tests in one process)."""
    return value


def buddy_distance(nodes: Sequence[Any]) -> int:
    """The distance ``d`` (1 to ``len(nodes) - 1``) for which the fewest ranks ``r`` share a node with rank
    ``r + d``: with as many ranks on every node, none does, and a node lost takes no slice with it."""
    n = len(nodes)
    return min(range(1, max(2, n)), key=lambda d: sum(nodes[r] == nodes[(r + d) % n] for r in range(n)))


def _copy_of(rank: int, world: int, buddy: Optional[int]) -> Optional[int]:
    """The rank whose slice rank ``rank`` keeps a copy of, ``buddy`` ranks on; ``None`` for none."""
    return None if buddy is None or world < 2 else (rank + buddy) % world


def _sharded_state(inner: Any, rank: int, world: int, copy: Any, owner: Optional[int]) -> ShardedState:
    return ShardedState(
        inner, torch.tensor(rank), torch.tensor(world), () if owner is None else (torch.tensor(owner), copy)
    )


def init_opt_state(
    optimizer: GradientTransformation,
    params: dict[str, torch.Tensor],
    layout: ShardLayout,
    rank: int,
    buddy: Optional[int] = None,
) -> ShardedState:
    """Rank ``rank``'s :class:`ShardedState`, initialised on its pieces only (no whole state is ever built);
    with ``buddy`` (a distance, see :func:`buddy_distance`), rank ``rank + buddy``'s too.

    Raises:
        ConfigError: the optimizer cannot be sharded (``from_torch``).
    """
    owner = _copy_of(rank, layout.world, buddy)
    with sharded(_full_view(params, _alone)):
        inner, copy = (
            None if r is None else optimizer.init({n: t.clone() for n, t in _cut(params, layout, r).items()})
            for r in (rank, owner)
        )
    return _sharded_state(inner, rank, layout.world, copy, owner)


def _per_param(keys: tuple[Any, ...], layout: ShardLayout) -> Optional[str]:
    """The parameter a state leaf belongs to: the innermost dict key on its path that names one."""
    names = set(layout.names)
    return next((k for k in reversed(keys) if isinstance(k, str) and k in names), None)


def split_opt_state(full: Any, layout: ShardLayout, rank: int, buddy: Optional[int] = None) -> ShardedState:
    """Rank ``rank``'s part of an unsharded optimizer state ``full`` (its per-parameter tensors cut into
    pieces); with ``buddy`` (a distance), a copy of rank ``rank + buddy``'s part too."""
    owner = _copy_of(rank, layout.world, buddy)
    copy = None if owner is None else _split(full, layout, owner)
    return _sharded_state(_split(full, layout, rank), rank, layout.world, copy, owner)


def _split(full: Any, layout: ShardLayout, rank: int) -> Any:
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
    return pytree.unflatten(out, spec)


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
    state: TrainState,
    rank: int,
    world: int,
    optimizer: Optional[GradientTransformation] = None,
    buddy: Optional[int] = None,
) -> TrainState:
    """Rank ``rank``'s sharded copy of ``state``: its optimizer state cut into this rank's pieces (and,
    with ``buddy``, a copy of rank ``rank + buddy``'s).

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
        init_opt_state(optimizer, state.params, layout, rank, buddy)
        if optimizer is not None
        else split_opt_state(current, layout, rank, buddy)
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
    one into the slice of the state before last and updates that in place.  A buddy copy of another rank's
    slice is updated in place once the all-gather has committed (nothing can abandon the step after it).
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
    return _pieces_of_chunk(sync.reduce_scatter(flat, layout.counts()), layout, rank)


def _pieces_of_chunk(chunk: torch.Tensor, layout: ShardLayout, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s pieces as views of its chunk (laid out flat)."""
    lo, _ = layout.bounds(rank)
    offset, out = 0, {}
    for name, n, (a, b) in zip(layout.names, layout.numels, layout.pieces(rank).values()):
        out[name] = chunk[offset + a - lo : offset + b - lo] if b > a else chunk[:0]
        offset += n
    return out


def next_gradients(
    pieces: dict[str, torch.Tensor], layout: ShardLayout, sync: ShardSync, owner: int
) -> dict[str, torch.Tensor]:
    """Rank ``owner``'s pieces of the summed gradients (for the buddy copy of its slice), from it; this
    rank's ``pieces`` go the other way, to the rank that keeps this one's copy (:meth:`ShardSync.shift_`)."""
    mine = torch.cat([p.reshape(-1) for p in pieces.values()])
    by = (owner - sync.rank) % sync.size
    return _pieces_of_chunk(sync.shift_(mine, layout.counts(), by), layout, owner)


def apply_sharded(
    optimizer: GradientTransformation,
    grads: dict[str, torch.Tensor],
    opt_state: Any,
    params: dict[str, torch.Tensor],
    sync: Optional[ShardSync],
    buffers: Optional[ShardBuffers] = None,
    next_grads: Optional[dict[str, torch.Tensor]] = None,
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
        next_grads: the next rank's pieces of the summed gradients (:func:`next_gradients`), which a
            state with a buddy copy needs.

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
    if opt_state.copy is not None and next_grads is None:
        raise TrainingError("this optimizer state keeps a buddy copy: pass the next rank's gradients (next_grads)")
    sums = _Sums(_alone if sync is None else sync.sum_)
    own_view, replay_view = _full_view(params, sums.record), _full_view(params, sums.replay)
    if buffers is None:
        with sharded(own_view):
            new_pieces, inner = apply_gradients(optimizer, grads, opt_state.inner_state, _cut(params, layout, rank))
        out = gather_params(new_pieces, layout, sync)
        copy = _buddy_update(optimizer, next_grads, opt_state, params, layout, replay_view, opt_state.copy, False)
        return out, _with(opt_state, inner, copy)
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
    own = state is not opt_state.inner_state  # the step's own memory: written in place
    with sharded(own_view):
        new_pieces, inner = apply_gradients(optimizer, grads, state, pieces, donate=own)
    for name, piece in pieces.items():  # a transformation may hand back new tensors instead of writing in place
        if new_pieces[name].data_ptr() != piece.data_ptr():
            piece.copy_(new_pieces[name])
    out = gather_params(pieces, layout, sync, into=flat)
    # The step has committed: the buddy copy is updated only now, in place where the caller donated its state
    # (a step abandoned in the all-gather left it as it was; no collective follows that could abandon this).
    copy = _buddy_update(optimizer, next_grads, opt_state, params, layout, replay_view, opt_state.copy, donated)
    buffers.committed(flat, inner, (_flat_of(params), pytree.leaves(opt_state.inner_state)) if donated else None)
    return out, _with(opt_state, inner, copy)


def _with(state: ShardedState, inner: Any, copy: Any) -> ShardedState:
    return state._replace(inner_state=inner, buddy=() if copy is None else (state.buddy[0], copy))


class _Sums:
    """The cross-rank sums of a rank's own update, recorded to be replayed for its buddy copy: the copy
    then sees the very values its owner saw (no second round of collectives, bit-identical results)."""

    def __init__(self, sum_: Any) -> None:
        self.sum_ = sum_
        self.seen: list[torch.Tensor] = []

    def record(self, value: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.sum_(value)
        self.seen.append(out.clone())
        return out

    def replay(self, value: torch.Tensor) -> torch.Tensor:
        return value.copy_(self.seen.pop(0))


def _buddy_update(
    optimizer: GradientTransformation,
    next_grads: Optional[dict[str, torch.Tensor]],
    opt_state: ShardedState,
    params: dict[str, torch.Tensor],
    layout: ShardLayout,
    view: ShardView,
    copy: Any,
    donate: bool,
) -> Any:
    """The buddy ``copy`` of rank ``opt_state.copy_rank``'s slice after this step (``None`` where none is
    kept): that rank's update, replayed here on the same gradients, parameters and sums.  The parameters it
    computes are dropped (the all-gather brings the owner's); ``donate`` lets it update ``copy`` in place."""
    if copy is None or next_grads is None:
        return copy
    pieces = {n: t.clone() for n, t in _cut(params, layout, cast(int, opt_state.copy_rank)).items()}
    with sharded(view):
        return apply_gradients(optimizer, next_grads, copy, pieces, donate=donate)[1]


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


# --------------------------------------------------------------------------- a new world from the survivors


class SliceLost(TrainingError):
    """The members of a new group do not hold every slice of the sharded optimizer state (both copies of
    one were lost), or hold slices of different steps: the state must come from a checkpoint."""


@dataclasses.dataclass(frozen=True)
class Held:
    """What one member of a re-formed group holds: its rank in the old group of ``world``, the ``step`` of
    its state and ``copy_rank``, whose copy it keeps (``None``: none)."""

    rank: int
    world: int
    step: int
    copy_rank: Optional[int]

    @classmethod
    def of(cls, state: Optional[TrainState]) -> Optional[Held]:
        """What ``state`` holds (``None``: no state, a new member); a whole state counts as rank 0 of 1."""
        if state is None:
            return None
        opt = state.opt_state
        if not isinstance(opt, ShardedState):
            return cls(0, 1, int(state.step), None)
        return cls(int(opt.rank), int(opt.world), int(state.step), opt.copy_rank)


def plan_reshard(held: Sequence[Optional[Held]]) -> dict[int, tuple[int, bool]]:
    """Which member sends each slice of the old group: old rank ``k`` -> ``(member, from its buddy copy)``.

    ``held[j]`` is member ``j``'s :class:`Held` (``None`` for a member with no state).  Every member
    computes the same plan from the same list.

    Raises:
        SliceLost: a slice no member holds (naming it and the ranks that held it), members of
            different groups, or states of different steps.
    """
    states = {j: h for j, h in enumerate(held) if h is not None}
    if not states:
        raise SliceLost("no member holds a state")
    worlds, steps = {h.world for h in states.values()}, {h.step for h in states.values()}
    if len(worlds) > 1 or len(steps) > 1:
        raise SliceLost(
            f"the survivors hold slices of groups of {sorted(worlds)} rank(s) at steps {sorted(steps)}: "
            "they do not make one state"
        )
    world = worlds.pop()
    plan: dict[int, tuple[int, bool]] = {}
    lost = []
    for k in range(world):
        own = [j for j, h in states.items() if h.rank == k]
        copies = [j for j, h in states.items() if h.copy_rank == k]
        if own or copies:
            plan[k] = (own[0], False) if own else (copies[0], True)
        else:
            lost.append(k)
    if lost:
        raise SliceLost(
            f"slice(s) {lost} of the sharded optimizer state were held only by the lost ranks (each slice lives on "
            "its own rank and, with a buddy copy, on one other): both copies are gone"
        )
    return plan


@dataclasses.dataclass(frozen=True)
class _Piece:
    """A skeleton's stand-in for a per-parameter piece: which parameter, and its dtype."""

    name: str
    dtype: torch.dtype


def _piece_names(inner: Any, layout: ShardLayout, rank: int) -> list[Optional[str]]:
    """For each leaf of rank ``rank``'s inner state, the parameter it is a piece of (``None``: a whole leaf)."""
    pieces = layout.pieces(rank)
    out: list[Optional[str]] = []
    for keys, leaf in zip(pytree.dict_keys_of_leaves(inner), pytree.leaves(inner)):
        name = _per_param(keys, layout)
        is_piece = (
            name is not None
            and isinstance(leaf, torch.Tensor)
            and leaf.ndim == 1
            and leaf.numel() == pieces[name][1] - pieces[name][0]
        )
        out.append(name if is_piece else None)
    return out


def _as_sharded(opt_state: Any, params: dict[str, torch.Tensor]) -> ShardedState:
    """A whole optimizer state as the one slice of a world of one; a sharded one as it is."""
    if isinstance(opt_state, ShardedState):
        return opt_state
    return split_opt_state(opt_state, ShardLayout.of(params, 1), 0)


def reshard_skeleton(opt_state: Any, params: dict[str, torch.Tensor]) -> Any:
    """The optimizer state's structure and whole leaves (counters, hyperparameters), with a stand-in for
    every per-parameter piece: what a member that holds no state needs besides the pieces."""
    state = _as_sharded(opt_state, params)
    layout = ShardLayout.of(params, int(state.world))
    leaves, spec = pytree.flatten(state.inner_state)
    names = _piece_names(state.inner_state, layout, int(state.rank))
    return pytree.unflatten([leaf if n is None else _Piece(n, leaf.dtype) for n, leaf in zip(names, leaves)], spec)


def _needs(rank: int, world: int, buddy: Optional[int]) -> list[int]:
    """The new slices rank ``rank`` of ``world`` holds: its own, then its buddy copy's."""
    owner = _copy_of(rank, world, buddy)
    return [rank] if owner is None else [rank, owner]


def reshard_messages(
    opt_state: Any,
    params: dict[str, torch.Tensor],
    plan: dict[int, tuple[int, bool]],
    member: int,
    world: int,
    buddy: Optional[int],
) -> list[list[tuple[int, int, int, torch.Tensor]]]:
    """What member ``member`` sends to each member of the new group of ``world``: for every slice the
    ``plan`` gives it, the parts each new rank needs (its own slice and, with ``buddy``, its copy), as
    ``(new slice, leaf index, offset in the new piece, tensor)``."""
    out: list[list[tuple[int, int, int, torch.Tensor]]] = [[] for _ in range(world)]
    state = _as_sharded(opt_state, params)
    old, new = ShardLayout.of(params, int(state.world)), ShardLayout.of(params, world)
    for k, (sender, from_copy) in plan.items():
        if sender != member:
            continue
        inner = state.copy if from_copy else state.inner_state
        leaves, names = pytree.leaves(inner), _piece_names(inner, old, k)
        have = old.pieces(k)
        for j in range(world):
            for c in _needs(j, world, buddy):
                want = new.pieces(c)
                for i, (name, leaf) in enumerate(zip(names, leaves)):
                    if name is None:
                        continue
                    (a, b), (a2, b2) = have[name], want[name]
                    lo, hi = max(a, a2), min(b, b2)
                    if lo < hi:
                        # (a copy on the host: a view would carry its whole storage, a GPU tensor its device)
                        out[j].append((c, i, lo - a2, leaf[lo - a : hi - a].to("cpu", copy=True)))
    return out


def reshard_receive(
    received: Sequence[Sequence[tuple[int, int, int, torch.Tensor]]],
    skeleton: Any,
    params: dict[str, torch.Tensor],
    rank: int,
    world: int,
    buddy: Optional[int],
) -> Any:
    """This rank's optimizer state in the new group of ``world``, from the parts every member sent it
    (:func:`reshard_messages`) and the :func:`reshard_skeleton`: a :class:`ShardedState`, or the whole
    state in a world of one.

    Raises:
        SliceLost: the parts do not cover this rank's slices (a plan that was not every member's).
    """
    layout = ShardLayout.of(params, world)
    leaves, spec = pytree.flatten(skeleton)
    trees = {}
    for c in _needs(rank, world, buddy):
        pieces = layout.pieces(c)
        built = [
            torch.empty(pieces[x.name][1] - pieces[x.name][0], dtype=x.dtype) if isinstance(x, _Piece) else x
            for x in leaves
        ]
        filled = [0] * len(built)
        for part in received:
            for slice_, i, offset, tensor in part:
                if slice_ == c:
                    built[i][offset : offset + tensor.numel()] = tensor
                    filled[i] += tensor.numel()
        short = [i for i, x in enumerate(leaves) if isinstance(x, _Piece) and filled[i] != built[i].numel()]
        if short:
            raise SliceLost(f"the parts received for slice {c} do not cover leaves {short}")
        trees[c] = pytree.unflatten(built, spec)
    owner = _copy_of(rank, world, buddy)
    state = _sharded_state(trees[rank], rank, world, None if owner is None else trees[owner], owner)
    return gather_opt_state([state], layout) if world == 1 else state
