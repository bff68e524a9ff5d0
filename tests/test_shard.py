"""shard_optimizer (ZeRO-2) in one process: N ranks as threads over an in-process ShardSync, against the
unsharded step on the whole batch; the layout, the state's split and gather (resharding), and the refusals."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raympi.core import optim, pytree
from raympi.core.precision import LossScaling
from raympi.core.shard import (
    ShardLayout,
    apply_sharded,
    gather_opt_state,
    gather_params,
    Held,
    SliceLost,
    buddy_distance,
    init_opt_state,
    plan_reshard,
    reshard_messages,
    reshard_receive,
    reshard_skeleton,
    shard_state,
    split_opt_state,
)
from raympi.core.state import TrainState
from raympi.core.step import make_train_step
from raympi.exceptions import ConfigError
from test_step import _RankSync, _run_ranks, _ThreadAllreduce

torch.set_num_threads(1)


def run_ranks(size: int, fn: Callable[[_RankSync], Any]) -> list[Any]:
    """``fn(sync)`` on ``size`` threads, each rank's in-process ShardSync; their results in rank order."""
    return _run_ranks(size, lambda rank, sync: fn(sync))


# --------------------------------------------------------------------------- the model and the runs


class TwoInputs(nn.Module):
    """Two inputs, odd sizes (73 + 5 + ... elements: the chunks cut through parameters), a norm layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(7, 9)
        self.b = nn.Linear(3, 9)
        self.norm = nn.LayerNorm(9)
        self.head = nn.Linear(9, 2)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.norm(self.a(x) + self.b(z))))


def _batch(step: int, n: int = 12) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(n, 7, generator=g), torch.randn(n, 3, generator=g)), torch.randn(n, 2, generator=g)


def _local(batch: Any, rank: int, size: int) -> Any:
    (x, z), y = batch
    idx = torch.tensor_split(torch.arange(len(y)), size)[rank]
    return (x[idx], z[idx]), y[idx]


def _decay(params: dict[str, torch.Tensor]) -> dict[str, bool]:
    return {n: p.ndim >= 2 for n, p in params.items()}


OPTIMIZERS: dict[str, Callable[[], Any]] = {
    "adamw+mask": lambda: optim.adamw(0.05, weight_decay=0.1, mask=_decay),
    "clip+sgd momentum": lambda: optim.chain(optim.clip_by_global_norm(0.05), optim.sgd(0.1, momentum=0.9)),
    "masked+multi_transform": lambda: optim.chain(
        optim.scale_by_adam(),
        optim.masked(optim.add_decayed_weights(0.1), _decay),
        optim.multi_transform(
            {"body": optim.scale_by_learning_rate(0.02), "head": optim.set_to_zero()},
            lambda p: {n: "head" if n.startswith("head.") else "body" for n in p},
        ),
    ),
    "inject_hyperparams+ema": lambda: optim.chain(
        optim.inject_hyperparams(optim.adam)(optim.cosine_decay(0.05, 10)), optim.ema(0.9, debias=True)
    ),
    "apply_if_finite": lambda: optim.apply_if_finite(optim.adam(0.05)),
}


def _reference(opt_fn: Callable[[], Any], steps: int, **options: Any) -> TrainState:
    model = TwoInputs()
    step = make_train_step(model, F.mse_loss, opt_fn(), **options)
    state = TrainState.create(model, opt_fn(), loss_scaling=options.get("loss_scaling"))
    for i in range(steps):
        state, _ = step(state, _batch(i))
    return state


def _sharded(
    opt_fn: Callable[[], Any],
    size: int,
    steps: int,
    shard: bool = True,
    buddy: int | None = None,
    first: int = 0,
    start: list[TrainState] | None = None,
    **options: Any,
) -> list[TrainState]:
    """``steps`` steps from step ``first`` on ``size`` threads: from each rank's ``start`` state, else from a
    new one (sharded with a ``buddy`` copy at that distance where given)."""
    models = [TwoInputs() for _ in range(size)]  # here: torch.manual_seed is process-wide, not per thread

    def rank_run(member: _RankSync) -> TrainState:
        model = models[member.rank]
        sync = member if size > 1 else None
        step = make_train_step(model, F.mse_loss, opt_fn(), grad_sync=sync, shard_optimizer=shard, **options)
        state = TrainState.create(model, opt_fn(), loss_scaling=options.get("loss_scaling"))
        if buddy is not None:
            state = shard_state(state, member.rank, size, opt_fn(), buddy=buddy)
        if start is not None:
            state = start[member.rank]
        for i in range(first, first + steps):
            state, metrics = step(state, _local(_batch(i), member.rank, size), len(_batch(i)[1]))
        return state

    return run_ranks(size, rank_run)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sharded_steps_equal_unsharded(name: str, size: int) -> None:
    ref = _reference(OPTIMIZERS[name], 4)
    states = _sharded(OPTIMIZERS[name], size, 4)
    for s in states:
        assert isinstance(s.opt_state, optim.ShardedState) and int(s.opt_state.world) == size
        assert _max_diff(s.params, ref.params) <= 1e-5
    layout = ShardLayout.of(ref.params, size)
    whole = gather_opt_state([s.opt_state for s in states], layout)
    ref_leaves, ref_spec = pytree.flatten(ref.opt_state)
    got_leaves, got_spec = pytree.flatten(whole)
    assert got_spec == ref_spec
    for a, b in zip(got_leaves, ref_leaves):
        assert a.shape == b.shape and (a.float() - b.float()).abs().max().item() <= 1e-5
    ema = optim.ema_params(whole)
    if ema is not None:  # the average is sharded too: gathered, it is the unsharded one
        assert _max_diff(ema, optim.ema_params(ref.opt_state)) <= 1e-5


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize(
    "options",
    [dict(accumulate=2), dict(precision="bf16"), dict(precision="fp16", loss_scaling=LossScaling(init_scale=2.0**8))],
    ids=["accumulate", "bf16", "fp16"],
)
def test_sharded_precision_and_accumulation(options: dict[str, Any], size: int) -> None:
    """Against the unsharded step over the same ranks (bf16/fp16 forwards round per rank's batch)."""
    opt = OPTIMIZERS["adamw+mask"]
    refs = _sharded(opt, size, 3, shard=False, **options)
    for s, ref in zip(_sharded(opt, size, 3, **options), refs):
        assert _max_diff(s.params, ref.params) <= 1e-5
        assert all(torch.equal(s.loss_scale[k], ref.loss_scale[k]) for k in ref.loss_scale)


def test_fp16_overflow_skips_on_every_rank() -> None:
    """The overflow verdict on the summed slices is summed over the ranks: every rank skips alike."""

    models = [TwoInputs() for _ in range(3)]

    def rank_run(member: _RankSync) -> tuple[TrainState, dict[str, Any], TrainState]:
        model = models[member.rank]
        step = make_train_step(
            model,
            F.mse_loss,
            optim.adam(0.01),
            grad_sync=member,
            shard_optimizer=True,
            precision="fp16",
            loss_scaling=LossScaling(init_scale=2.0**127),  # scaled gradients overflow float32: inf on every slice
        )
        state = TrainState.create(model, optim.adam(0.01))
        new, metrics = step(state, _local(_batch(0), member.rank, 3), 12)
        return state, metrics, new

    for before, metrics, after in run_ranks(3, rank_run):
        assert metrics["skipped"] == 1
        assert _max_diff(after.params, before.params) == 0.0
        assert after.loss_scale["scale"].item() == 2.0**126


def test_apply_if_finite_agrees_when_one_slice_is_not_finite() -> None:
    params = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}
    opt = optim.apply_if_finite(optim.sgd(0.1), max_consecutive_errors=3)
    layout = ShardLayout.of(params, 3)  # chunks of 4: rank 1 holds w[4:6] and b[0:2]

    def rank_run(member: _RankSync) -> tuple[dict[str, torch.Tensor], Any]:
        state = init_opt_state(opt, params, layout, member.rank)
        grads = {n: torch.ones(b - a) for n, (a, b) in layout.pieces(member.rank).items()}
        if member.rank == 1:
            grads["b"][0] = float("nan")  # only rank 1 sees it
        new, state = apply_sharded(opt, grads, state, params, member)
        return new, state

    for new, state in run_ranks(3, rank_run):
        assert _max_diff(new, params) == 0.0  # skipped everywhere
        assert int(state.inner_state.notfinite_count) == 1


def test_masks_see_whole_shapes_never_slices() -> None:
    seen: list[tuple[int, ...]] = []

    def mask(params: dict[str, torch.Tensor]) -> dict[str, bool]:
        seen.extend(tuple(p.shape) for p in params.values())
        return {n: p.ndim >= 2 for n, p in params.items()}

    opt = lambda: optim.adamw(0.05, weight_decay=0.5, mask=mask)  # noqa: E731
    ref = _reference(opt, 2)
    shapes = {tuple(p.shape) for p in ref.params.values()}
    seen.clear()
    for s in _sharded(opt, 3, 2):
        assert _max_diff(s.params, ref.params) <= 1e-5
    assert seen and set(seen) <= shapes


@pytest.mark.parametrize("size", [1, 2, 3])
def test_donating_steps_reuse_buffers_and_equal_pure_ones(size: int) -> None:
    opt = OPTIMIZERS["clip+sgd momentum"]
    pure = _sharded(opt, size, 5)
    donated = _sharded(opt, size, 5, donate=True)
    for a, b in zip(donated, pure):
        assert _max_diff(a.params, b.params) == 0.0


def test_a_step_abandoned_in_the_all_gather_leaves_the_donated_state_whole() -> None:
    """Aborted between the reduce-scatter and the all-gather: the state is still the last step's, and the
    step run again gives what an uninterrupted run gives."""
    from raympi.exceptions import CollectiveAborted

    class Flaky(_RankSync):
        fail_at: set[int] = {3, 4}
        gathers = 0

        def all_gather_(self, flat: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
            Flaky.gathers += 1
            if Flaky.gathers in self.fail_at:
                flat.fill_(float("nan"))  # what a half-done collective may have written
                raise CollectiveAborted("abandoned")
            return super().all_gather_(flat, counts)

    model, opt = TwoInputs(), OPTIMIZERS["adamw+mask"]
    flaky = Flaky(_ThreadAllreduce(1), 0)
    step = make_train_step(model, F.mse_loss, opt(), grad_sync=flaky, shard_optimizer=True, donate=True)
    state = TrainState.create(model, opt())
    i = 0
    while i < 6:
        before = {k: v.clone() for k, v in state.params.items()}
        moments = [t.clone() for t in pytree.leaves(state.opt_state)]
        try:
            state, _ = step(state, _batch(i))
        except CollectiveAborted:
            assert _max_diff(state.params, before) == 0.0
            assert all(torch.equal(a, b) for a, b in zip(pytree.leaves(state.opt_state), moments))
            continue  # the same step again, as after a warm restart
        i += 1
    assert _max_diff(state.params, _reference(opt, 6).params) <= 1e-5


# --------------------------------------------------------------------------- layout, split, gather


def test_layout_cuts_evenly_and_covers_everything() -> None:
    params = {"a": torch.zeros(5, 2), "b": torch.zeros(3), "c": torch.zeros(())}
    for world in (1, 2, 3, 4, 7, 20):
        layout = ShardLayout.of(params, world)
        assert sum(layout.counts()) == 14 and max(layout.counts()) == math.ceil(14 / world)
        covered = {n: 0 for n in params}
        for r in range(world):
            for n, (a, b) in layout.pieces(r).items():
                covered[n] += b - a
        assert covered == {"a": 10, "b": 3, "c": 1}


@pytest.mark.parametrize("n, m", [(3, 2), (2, 3), (1, 4), (4, 1)])
def test_reshard_n_to_m_is_exact(n: int, m: int) -> None:
    params = {"w": torch.randn(5, 3), "b": torch.randn(5), "s": torch.randn(())}
    opt = optim.chain(optim.adamw(0.1, mask=_decay), optim.ema(0.5))
    state = opt.init(params)
    g = {k: torch.randn_like(v) for k, v in params.items()}
    params2, state = optim.apply_gradients(opt, g, state, params)
    parts = [split_opt_state(state, ShardLayout.of(params2, n), r) for r in range(n)]
    whole = gather_opt_state(parts, ShardLayout.of(params2, n))
    again = gather_opt_state(
        [split_opt_state(whole, ShardLayout.of(params2, m), r) for r in range(m)], ShardLayout.of(params2, m)
    )
    for a, b in zip(pytree.leaves(again), pytree.leaves(state)):
        assert torch.equal(a, b)
    # and a ShardedState round-trips through a checkpoint's plain form
    plain = optim.from_plain(optim.to_plain(parts[0]))
    assert isinstance(plain, optim.ShardedState) and int(plain.world) == n


def test_gather_params_one_rank_is_the_whole() -> None:
    params = {"w": torch.randn(4, 3), "b": torch.randn(2)}
    layout = ShardLayout.of(params, 1)
    out = gather_params({n: p.reshape(-1) for n, p in params.items()}, layout, None)
    assert all(torch.equal(out[n], params[n]) for n in params)


def test_wrong_world_is_refused() -> None:
    params = {"w": torch.randn(4, 3)}
    state = init_opt_state(optim.adam(0.1), params, ShardLayout.of(params, 2), 0)
    with pytest.raises(Exception, match="gather it first"):
        apply_sharded(optim.adam(0.1), {"w": torch.zeros(12)}, state, params, None)


# --------------------------------------------------------------------------- refusals


def test_refusals_name_the_reason() -> None:
    model = TwoInputs()
    with pytest.raises(ConfigError, match="from_torch"):
        init_opt_state(
            optim.from_torch(torch.optim.RMSprop, lr=0.1),
            dict(model.named_parameters()),
            ShardLayout.of(dict(model.named_parameters()), 2),
            0,
        )
    with pytest.raises(ConfigError, match="overlap"):
        make_train_step(
            model,
            F.mse_loss,
            optim.sgd(0.1),
            grad_sync=_ThreadAllreduce(2).for_rank(0),
            overlap=True,
            shard_optimizer=True,
        )
    with pytest.raises(ConfigError, match="reduce_scatter"):
        make_train_step(model, F.mse_loss, optim.sgd(0.1), grad_sync=lambda tree: None, shard_optimizer=True)
    mixed = TwoInputs()
    mixed.head.to(torch.float64)
    with pytest.raises(ConfigError, match="one dtype"):
        make_train_step(mixed, F.mse_loss, optim.sgd(0.1), shard_optimizer=True)


# --------------------------------------------------------------------------- buddy copies and resharding survivors


def _equal_trees(a: Any, b: Any) -> bool:
    la, sa = pytree.flatten(a)
    lb, sb = pytree.flatten(b)
    return sa == sb and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb))


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_buddy_copies_equal_their_owners_bit_for_bit(name: str, size: int, donate: bool) -> None:
    """Each rank's copy of another's slice is updated from the same sums (the global norm and the
    finiteness verdict replayed): it equals the owner's own, and the parameters the unsharded run's."""
    ref = _reference(OPTIMIZERS[name], 4)
    states = _sharded(OPTIMIZERS[name], size, 4, buddy=size - 1, donate=donate)
    for rank, s in enumerate(states):
        assert _max_diff(s.params, ref.params) <= 1e-5
        owner = s.opt_state.copy_rank
        assert owner == (rank + size - 1) % size
        assert _equal_trees(s.opt_state.copy, states[owner].opt_state.inner_state)


def test_buddy_copies_under_fp16_and_accumulation() -> None:
    options = dict(precision="fp16", loss_scaling=LossScaling(init_scale=2.0**8), accumulate=2)
    refs = _sharded(OPTIMIZERS["adamw+mask"], 3, 3, shard=False, **options)
    states = _sharded(OPTIMIZERS["adamw+mask"], 3, 3, buddy=1, **options)
    for rank, (s, ref) in enumerate(zip(states, refs)):
        assert _max_diff(s.params, ref.params) <= 1e-5
        assert _equal_trees(s.opt_state.copy, states[(rank + 1) % 3].opt_state.inner_state)


def test_buddy_distance_puts_copies_on_other_nodes() -> None:
    assert buddy_distance(["a", "a", "b", "b"]) == 2
    assert buddy_distance(["a", "b", "a", "b"]) == 1
    assert buddy_distance(["a", "a", "a", "b", "b", "b"]) == 3
    assert buddy_distance(["a", "a", "a"]) == 1  # one node: any distance, the smallest
    assert buddy_distance(["a"]) == 1


def _survivors_to(states: list[TrainState], kept: list[int], newcomers: int, buddy: int | None) -> list[Any]:
    """Re-shard the optimizer states of the ranks ``kept`` (in that order) plus ``newcomers`` members with
    no state, as the workers do: a plan, every member's parts, every member's receipt."""
    members: list[TrainState | None] = [states[k] for k in kept] + [None] * newcomers
    world = len(members)
    plan = plan_reshard([Held.of(m) for m in members])
    params = states[0].params
    parts = [
        reshard_messages(m.opt_state, params, plan, j, world, buddy) if m is not None else [[]] * world
        for j, m in enumerate(members)
    ]
    skeleton = reshard_skeleton(states[kept[0]].opt_state, params)
    return [reshard_receive([p[j] for p in parts], skeleton, params, j, world, buddy) for j in range(world)]


@pytest.mark.parametrize(
    "size,kept,newcomers",
    [(3, [0, 2], 1), (3, [0, 2], 0), (4, [1, 2, 3], 0), (4, [0, 1, 3], 2), (2, [1], 0), (2, [0], 1), (3, [1, 2], 0)],
)
def test_survivors_reshard_to_the_new_world_exactly(size: int, kept: list[int], newcomers: int) -> None:
    """After a rank is lost, the survivors' slices and copies make the new world's slices (and copies), bit
    for bit what splitting the whole state gives; and training on from them equals the uninterrupted run."""
    opt = OPTIMIZERS["clip+sgd momentum"]
    states = _sharded(opt, size, 3, buddy=1, donate=True)
    whole = gather_opt_state([s.opt_state for s in states], ShardLayout.of(states[0].params, size))
    world = len(kept) + newcomers
    new_buddy = 1 if world > 1 else None
    got = _survivors_to(states, kept, newcomers, new_buddy)
    layout = ShardLayout.of(states[0].params, world)
    for j, opt_state in enumerate(got):
        want = whole if world == 1 else split_opt_state(whole, layout, j, new_buddy)
        assert _equal_trees(opt_state, want)
    if world > 1:  # two more steps in the new world, against six uninterrupted ones
        resumed = _sharded(opt, world, 3, first=3, start=[states[0].replace(opt_state=o) for o in got])
        ref = _reference(opt, 6)
        for s in resumed:
            assert _max_diff(s.params, ref.params) <= 1e-5


def test_losing_both_copies_of_a_slice_is_named() -> None:
    states = _sharded(OPTIMIZERS["clip+sgd momentum"], 3, 1, buddy=1)
    # rank r keeps rank r+1's copy: losing ranks 1 and 2 loses slice 2 (on rank 2, copied on rank 1)
    with pytest.raises(SliceLost, match=r"slice\(s\) \[2\]"):
        plan_reshard([Held.of(states[0]), None, None])
    unbuddied = _sharded(OPTIMIZERS["clip+sgd momentum"], 3, 1)
    with pytest.raises(SliceLost, match=r"\[1\]"):
        plan_reshard([Held.of(unbuddied[0]), Held.of(unbuddied[2])])
    behind = Held.of(states[2])
    assert behind is not None
    with pytest.raises(SliceLost, match="steps"):
        plan_reshard([Held.of(states[0]), Held(behind.rank, behind.world, behind.step - 1, behind.copy_rank)])


def test_a_step_abandoned_in_the_all_gather_leaves_the_buddy_copies_as_they_were() -> None:
    """Two ranks with buddy copies, the all-gather abandoned twice on both: every retried step ends where the
    uninterrupted run does, and each copy still equals its owner's slice bit for bit."""
    from raympi.exceptions import CollectiveAborted

    opt = OPTIMIZERS["adamw+mask"]
    models = [TwoInputs() for _ in range(2)]

    def rank_run(member: _RankSync) -> TrainState:
        gathers = [0]
        real = member.all_gather_

        def flaky(flat: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
            gathers[0] += 1
            if gathers[0] in (3, 4):
                member._exchange(None)  # (both ranks meet, as a collective would, then give up)
                flat.fill_(float("nan"))
                raise CollectiveAborted("abandoned")
            return real(flat, counts)

        member.all_gather_ = flaky  # type: ignore[method-assign]
        model = models[member.rank]
        step = make_train_step(model, F.mse_loss, opt(), grad_sync=member, shard_optimizer=True, donate=True)
        state = shard_state(TrainState.create(model, opt()), member.rank, 2, opt(), buddy=1)
        i = 0
        while i < 5:
            copy = [t.clone() for t in pytree.leaves(state.opt_state.copy)]
            try:
                state, _ = step(state, _local(_batch(i), member.rank, 2), 12)
            except CollectiveAborted:
                assert all(torch.equal(a, b) for a, b in zip(pytree.leaves(state.opt_state.copy), copy))
                continue
            i += 1
        return state

    states = run_ranks(2, rank_run)
    ref = _reference(opt, 5)
    for rank, s in enumerate(states):
        assert _max_diff(s.params, ref.params) <= 1e-5
        assert _equal_trees(s.opt_state.copy, states[1 - rank].opt_state.inner_state)


def test_16bit_parameters_summed_in_16_bits_match_the_unsharded_sums() -> None:
    """A bfloat16 model whose gradients are summed in bfloat16 (as gloo and NCCL do without fp32_reduce): the
    sharded run, with buddy copies, stays within 1e-3 of the unsharded one over the same ranks."""
    opt = OPTIMIZERS["adamw+mask"]
    models = [TwoInputs().to(torch.bfloat16) for _ in range(2)]

    def run(shard: bool) -> list[TrainState]:
        def rank_run(member: _RankSync) -> TrainState:
            model = models[member.rank]
            step = make_train_step(model, F.mse_loss, opt(), grad_sync=member, shard_optimizer=shard, donate=True)
            state = TrainState.create(model, opt())
            if shard:
                state = shard_state(state, member.rank, 2, opt(), buddy=1)
            for i in range(3):
                (x, z), y = _local(_batch(i), member.rank, 2)
                state, _ = step(state, ((x.bfloat16(), z.bfloat16()), y.bfloat16()), 12)
            return state

        return run_ranks(2, rank_run)

    for s, ref in zip(run(True), run(False)):
        assert all(p.dtype == torch.bfloat16 for p in s.params.values())
        assert _max_diff(s.params, ref.params) <= 1e-3
