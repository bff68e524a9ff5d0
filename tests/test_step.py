"""train_step / eval_step against plain PyTorch, the global-batch rule, purity, and errors."""

from __future__ import annotations

import copy
import importlib.util
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raympi.core import optim, pytree
from raympi.core.metrics import StatsLayout, read_stats, stats_row
from raympi.core.precision import LossScaling
from raympi.core.state import TrainState
from raympi.core.rng import step_seed
from raympi.core.step import make_eval_step, make_train_step
from raympi.exceptions import ConfigError, NonFiniteLossError, TrainingError

torch.set_num_threads(1)


def _mlp(dropout: float = 0.0, batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(10, 32)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(32))
    layers += [nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 4)]
    return nn.Sequential(*layers)


def _batch(step: int, n: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 10, generator=g), torch.randint(0, 4, (n,), generator=g)


def _close(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k].detach(), rtol=tol, atol=tol, msg=k)


def _assert_identical(a, b) -> None:
    la, sa = pytree.flatten(a)
    lb, sb = pytree.flatten(b)
    assert sa == sb
    for x, y in zip(la, lb):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


# --------------------------------------------------------------------------- against plain PyTorch


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (lambda: optim.sgd(0.05, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
        (lambda: optim.adamw(1e-3), lambda p: torch.optim.AdamW(p, lr=1e-3)),
    ],
    ids=["sgd_momentum", "adamw"],
)
def test_matches_plain_pytorch_loop(ours, theirs):
    """50 steps, BatchNorm and dropout included; the reference seeds dropout like train_step."""
    model = _mlp(dropout=0.2, batchnorm=True)
    opt = ours()
    state = TrainState.create(model, opt, seed=5)
    step_fn = make_train_step(model, F.cross_entropy, opt)

    ref = copy.deepcopy(model).train()
    ref_opt = theirs(ref.parameters())
    for step in range(50):
        x, y = _batch(step)
        state, metrics = step_fn(state, (x, y))

        torch.manual_seed(step_seed(5, step, 0))
        ref_opt.zero_grad()
        out = ref(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        ref_opt.step()
        assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-5)
        assert metrics["accuracy"] == (out.argmax(1) == y).sum().item() / 24
        assert metrics["samples"] == 24
    assert int(state.step) == 50
    _close(state.params, dict(ref.named_parameters()), 1e-5)
    _close(state.buffers, dict(ref.named_buffers()), 1e-5)


# --------------------------------------------------------------------------- the global-batch rule


class _ThreadAllreduce:
    """In-process stand-in for MPI Allreduce(SUM) (and the collectives of a sharded step): one thread per
    simulated rank."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world)
        self.slots: list = [None] * world

    def for_rank(self, rank: int) -> "_RankSync":
        return _RankSync(self, rank)


class _RankSync:
    """One rank's ``grad_sync``: called with a tree it returns the sums (every rank adds in rank order, so all
    get bit-identical results); ``reduce_scatter``, ``all_gather_``, ``sum_`` and ``shift_`` make it a ShardSync."""

    def __init__(self, group: _ThreadAllreduce, rank: int):
        self.group, self.rank, self.size = group, rank, group.world

    def _exchange(self, value):
        g = self.group
        g.slots[self.rank] = value
        g.barrier.wait()
        out = list(g.slots)
        g.barrier.wait()  # nobody overwrites a slot before all have read
        return out

    def __call__(self, tree):
        leaves, spec = pytree.flatten(tree)
        return pytree.unflatten([sum(parts[1:], parts[0]) for parts in zip(*self._exchange(leaves))], spec)

    def reduce_scatter(self, flat, counts):
        parts = self._exchange(flat.clone())
        chunk = max(counts)
        return sum(parts[1:], parts[0])[self.rank * chunk : self.rank * chunk + counts[self.rank]].clone()

    def all_gather_(self, flat, counts):
        parts, chunk = self._exchange(flat.clone()), max(counts)
        for r, part in enumerate(parts):
            flat[r * chunk : r * chunk + counts[r]] = part[r * chunk : r * chunk + counts[r]]
        return flat

    def sum_(self, value):
        parts = self._exchange(value.clone())
        return value.copy_(sum(parts[1:], parts[0]))

    def shift_(self, mine, counts, by):
        parts = self._exchange(mine.clone())
        return parts[(self.rank + by) % self.size].clone()


def _run_ranks(world: int, rank_main):
    """Run ``rank_main(rank, grad_sync)`` for each simulated rank in its own thread; return their results."""
    allreduce = _ThreadAllreduce(world)
    results: list = [None] * world
    errors: list = []

    def run(rank: int):
        try:
            results[rank] = rank_main(rank, allreduce.for_rank(rank))
        except BaseException as e:  # surface thread failures in the test
            errors.append(e)
            allreduce.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return results


def _train_split(sizes: list[int], steps: int = 20):
    """Train on the same global batches split as ``sizes``; one thread per rank."""
    world, total = len(sizes), sum(sizes)
    # Each rank its own module (functional_call swaps module attributes), built
    # here: initialising in the threads would race on the global RNG.
    models = [_mlp() for _ in range(world)]

    def rank_main(rank: int, grad_sync):
        model = models[rank]
        opt = optim.adam(1e-2)
        state = TrainState.create(model, opt)
        step_fn = make_train_step(model, F.cross_entropy, opt, grad_sync=grad_sync, rank=rank)
        lo = sum(sizes[:rank])
        history = []
        for step in range(steps):
            x, y = _batch(step, total)
            state, metrics = step_fn(state, (x[lo : lo + sizes[rank]], y[lo : lo + sizes[rank]]), total)
            history.append(metrics)
        return state, history

    return _run_ranks(world, rank_main)


def test_global_batch_rule_any_split_same_update():
    ((single, single_hist),) = _train_split([64])
    for sizes in ([22, 21, 21], [16, 16, 16, 16]):
        results = _train_split(sizes)
        for state, history in results:
            # Every rank holds the same state and sees the same global metrics.
            _assert_identical(state, results[0][0])
            assert history == results[0][1]
        state, history = results[0]
        _close(state.params, single.params, 1e-5)
        for ours, ref in zip(history, single_hist):
            assert ours["samples"] == 64
            assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-5)
            assert ours["accuracy"] == ref["accuracy"]


def test_grad_sync_may_sum_in_place_and_return_none():
    model = _mlp()
    opt = optim.sgd(0.1)
    state = TrainState.create(model, opt)
    seen = []

    def in_place(tree):  # world size 1: the sum is the identity
        seen.append(tree["stats"].tolist())
        return None

    a, ma = make_train_step(model, F.cross_entropy, opt, grad_sync=in_place)(state, _batch(0))
    b, mb = make_train_step(model, F.cross_entropy, opt)(state, _batch(0))
    _assert_identical(a, b)
    assert ma == mb
    loss_sum, correct, n, n_targets = seen[0]
    assert n == n_targets == 24 and loss_sum == pytest.approx(ma["loss"] * 24)


def test_global_batch_size_must_match_the_samples():
    model = _mlp()
    state = TrainState.create(model, optim.sgd(0.1))
    step_fn = make_train_step(model, F.cross_entropy, optim.sgd(0.1))
    with pytest.raises(TrainingError, match="global_batch_size is 48"):
        step_fn(state, _batch(0), 48)


def _abs_output(outputs, targets):
    return outputs.abs().mean()


def _true_class_prob(outputs, targets):
    return outputs.softmax(1).gather(1, targets[:, None]).mean()


@pytest.mark.parametrize("accumulate", [1, 3])
def test_user_metrics_are_global_means(accumulate):
    """Two simulated ranks of 5 and 11 samples: each metric is the mean over all 16, computed by hand."""
    sizes, total = [5, 11], 16
    x, y = _batch(3, total)
    models = [_mlp() for _ in sizes]
    fns = {"abs_out": _abs_output, "p_true": _true_class_prob}

    def rank_main(rank: int, grad_sync):
        opt = optim.sgd(0.1)
        step_fn = make_train_step(
            models[rank], F.cross_entropy, opt, grad_sync=grad_sync, rank=rank, accumulate=accumulate, metrics=fns
        )
        lo = sum(sizes[:rank])
        return step_fn(
            TrainState.create(models[rank], opt), (x[lo : lo + sizes[rank]], y[lo : lo + sizes[rank]]), total
        )[1]

    m0, m1 = _run_ranks(2, rank_main)
    assert m0 == m1
    with torch.no_grad():
        out = _mlp()(x)  # the metrics see the forward before the update
    assert set(m0) == {"loss", "accuracy", "samples", "abs_out", "p_true"}
    assert m0["abs_out"] == pytest.approx(out.abs().mean().item(), rel=1e-6)
    assert m0["p_true"] == pytest.approx(out.softmax(1)[torch.arange(total), y].mean().item(), rel=1e-6)
    assert m0["loss"] == pytest.approx(F.cross_entropy(out, y).item(), rel=1e-6)


def test_stats_row_layout_names_every_index():
    """The statistics row is read by name: StatsLayout says which index holds what, fp16's flags included."""
    layout = StatsLayout(("mae", "r2"), overflow_flags=True)
    assert (layout.LOSS_SUM, layout.CORRECT, layout.SAMPLES, layout.TARGETS) == (0, 1, 2, 3)
    assert (layout.metric("mae"), layout.metric("r2"), layout.rank_overflows, layout.sum_overflow) == (4, 5, 6, 7)
    outputs, targets = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 3.0]]), torch.tensor([0, 1, 1, 1])
    fns = {"mae": lambda o, t: torch.tensor(0.5), "r2": lambda o, t: torch.tensor(0.25)}
    row, classify = stats_row(torch.tensor(1.5), outputs, targets, 4, fns, layout)
    assert classify and row.tolist() == [6.0, 3.0, 4.0, 4.0, 2.0, 1.0]  # the flags are the step's to add
    read = read_stats(row.tolist() + [0.0, 0.0], layout, classify)
    assert read.metrics == {"loss": 1.5, "samples": 4, "accuracy": 0.75, "mae": 0.5, "r2": 0.25}
    assert read.loss_sum == 6.0 and not read.overflow
    assert read_stats(row.tolist() + [1.0, 0.0], layout, classify).overflow  # one rank overflowed
    assert read_stats(row.tolist() + [0.0, 1.0], layout, classify).overflow  # the sum overflowed
    assert not read_stats(row.tolist(), StatsLayout(("mae", "r2")), False).overflow  # no flags without fp16


def test_user_accuracy_replaces_the_automatic_one_and_names_are_checked():
    model = _mlp()
    opt = optim.sgd(0.1)
    state = TrainState.create(model, opt)
    top2 = lambda o, t: (o.topk(2, 1).indices == t[:, None]).any(1).float().mean()  # noqa: E731
    _, m = make_train_step(model, F.cross_entropy, opt, metrics={"accuracy": top2})(state, _batch(0))
    with torch.no_grad():
        out = model(_batch(0)[0])
    assert m["accuracy"] == pytest.approx(top2(out, _batch(0)[1]).item())
    for name in ("loss", "samples", "skipped", "loss_scale"):
        with pytest.raises(ConfigError, match=name):
            make_train_step(model, F.cross_entropy, opt, metrics={name: top2})
    bad = make_train_step(model, F.cross_entropy, opt, metrics={"per_sample": lambda o, t: o.sum(1)})
    with pytest.raises(TrainingError, match="'per_sample' must return a scalar"):
        bad(state, _batch(0))


# --------------------------------------------------------------------------- purity


def test_train_step_is_pure():
    model = _mlp(dropout=0.3, batchnorm=True)
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2))
    step_fn = make_train_step(model, F.cross_entropy, opt)
    state = TrainState.create(model, opt, seed=1)
    state, _ = step_fn(state, _batch(0))  # a non-trivial optimizer state
    snapshot = pytree.map(torch.clone, state)
    rng_before = torch.get_rng_state()
    module_before = copy.deepcopy(model.state_dict())

    first, m1 = step_fn(state, _batch(1))
    second, m2 = step_fn(state, _batch(1))
    _assert_identical(first, second)
    assert m1 == m2
    _assert_identical(state, snapshot)  # the input state is untouched
    assert torch.equal(torch.get_rng_state(), rng_before)  # so is the global RNG
    _assert_identical(model.state_dict(), module_before)  # and the template module
    assert not torch.equal(first.params["0.weight"], state.params["0.weight"])
    assert not torch.equal(first.buffers["1.running_mean"], state.buffers["1.running_mean"])


def test_donated_step_matches_pure_step():
    model = _mlp(dropout=0.3, batchnorm=True)
    opt = optim.sgd(0.05, momentum=0.9)
    pure_fn = make_train_step(model, F.cross_entropy, opt)
    donating_fn = make_train_step(model, F.cross_entropy, opt, donate=True)
    pure = TrainState.create(model, opt)
    donated = pytree.map(torch.clone, pure)
    weight = donated.params["0.weight"]
    for step in range(5):
        pure, m1 = pure_fn(pure, _batch(step))
        donated, m2 = donating_fn(donated, _batch(step))
        _assert_identical(donated, pure)
        assert m1 == m2
    assert donated.params["0.weight"] is weight  # updated in place all along


def test_seed_changes_dropout():
    model = _mlp(dropout=0.5)
    opt = optim.sgd(0.1)
    step_fn = make_train_step(model, F.cross_entropy, opt)
    a, _ = step_fn(TrainState.create(model, opt, seed=0), _batch(0))
    b, _ = step_fn(TrainState.create(model, opt, seed=1), _batch(0))
    assert not torch.equal(a.params["0.weight"], b.params["0.weight"])


# --------------------------------------------------------------------------- batch forms and eval


class TwoInputs(nn.Module):
    """``model(x, scale)``: a batched input and a 0-d one."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(10, 4)

    def forward(self, x, scale):
        return self.lin(x) * scale


def test_batch_forms():
    model = TwoInputs()
    opt = optim.sgd(0.1)
    state = TrainState.create(model, opt)
    step_fn = make_train_step(model, F.cross_entropy, opt)
    x, y = _batch(0)
    scale = torch.tensor(2.0)
    a, _ = step_fn(state, ((x, scale), y))
    b, _ = step_fn(state, {"inputs": {"x": x, "scale": scale}, "targets": y})
    _assert_identical(a, b)


def test_tied_weights_train_like_plain_pytorch():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(10, 10)
            self.dec = nn.Linear(10, 10)
            self.dec.weight = self.enc.weight  # one parameter, two names

        def forward(self, x):
            return self.dec(torch.tanh(self.enc(x)))

    torch.manual_seed(0)
    model = Tied()
    ref = copy.deepcopy(model)
    opt = optim.sgd(0.1, momentum=0.9)
    state = TrainState.create(model, opt)
    assert "dec.weight" not in state.params  # named_parameters lists a tied tensor once
    step_fn = make_train_step(model, F.mse_loss, opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(5):
        x, _ = _batch(step)
        state, _ = step_fn(state, (x, x))
        ref_opt.zero_grad()
        F.mse_loss(ref(x), x).backward()
        ref_opt.step()
    _close(state.params, dict(ref.named_parameters()), 1e-6)


def test_regression_targets_have_no_accuracy():
    model = nn.Linear(10, 1)
    opt = optim.sgd(0.1)
    x, _ = _batch(0)
    _, metrics = make_train_step(model, F.mse_loss, opt)(TrainState.create(model, opt), (x, x[:, :1]))
    assert set(metrics) == {"loss", "samples"}


def test_eval_step_sums_and_eval_mode():
    model = _mlp(dropout=0.5, batchnorm=True)
    opt = optim.sgd(0.1)
    state, _ = make_train_step(model, F.cross_entropy, opt)(TrainState.create(model, opt), _batch(0))
    eval_step = make_eval_step(
        model, {"loss": F.cross_entropy, "accuracy": lambda o, t: (o.argmax(1) == t).float().mean()}
    )
    batches = [_batch(10, 16), _batch(11, 8)]
    sums = [eval_step(state, b) for b in batches]

    ref = copy.deepcopy(model)
    ref.load_state_dict({**state.params, **state.buffers})
    ref.eval()
    with torch.no_grad():
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        out = ref(x)
    n = sum(s["samples"] for s in sums)
    assert n == 24
    assert sum(s["loss"] for s in sums) / n == pytest.approx(F.cross_entropy(out, y).item(), rel=1e-6)
    assert sum(s["accuracy"] for s in sums) / n == pytest.approx((out.argmax(1) == y).float().mean().item())
    assert model.training  # the mode is restored


def test_step_trains_in_train_mode_keeps_frozen_modules_and_gives_modes_back():
    """An eval-mode model trains in train mode and is left in eval. A BatchNorm the user froze in eval
    inside a training model (fine-tuning) stays frozen in the train step (its running statistics do
    not move) and after it. An eval step evaluates every module in eval and gives the modes back."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
    seen: list[bool] = []
    model[1].register_forward_hook(lambda m, i, o: seen.append(m.training))
    opt = optim.sgd(0.1)
    step = make_train_step(model, F.cross_entropy, opt)
    evaluate = make_eval_step(model, {"loss": F.cross_entropy})
    model.eval()
    state, _ = step(TrainState.create(model, opt), _batch(0))
    assert seen == [True] and not any(m.training for m in model.modules())
    model.train()
    model[1].eval()
    frozen, _ = step(state, _batch(1))
    assert seen == [True, False]
    torch.testing.assert_close(frozen.buffers["1.running_mean"], state.buffers["1.running_mean"], rtol=0, atol=0)
    assert [m.training for m in model.modules()] == [True, True, False, True, True]
    model.train()
    evaluate(state, _batch(2))
    assert seen == [True, False, False] and all(m.training for m in model.modules())


def test_modes_come_back_after_an_error_for_modules_added_later_and_from_an_overridden_train():
    class Net(nn.Sequential):
        def train(self, mode: bool = True):  # an override with a side effect on an unregistered helper
            self.__dict__["helper"].train(mode)
            return super().train(mode)

    model = Net(nn.Linear(10, 4))
    model.__dict__["helper"] = nn.Dropout()
    step = make_train_step(model, F.cross_entropy, optim.sgd(0.1))
    model.append(nn.Dropout())  # added after the step was built
    model.eval()
    model.__dict__["helper"].eval()
    state = TrainState.create(model, optim.sgd(0.1))
    step(state, _batch(0))
    assert not any(m.training for m in model.modules()) and not model.__dict__["helper"].training
    with pytest.raises(TrainingError):
        step(state, (torch.randn(4, 10), torch.randint(0, 4, (5,))))  # inputs and targets disagree
    assert not any(m.training for m in model.modules())
    with pytest.raises(RuntimeError):
        step(state, (torch.randn(4, 9), torch.randint(0, 4, (4,))))  # fails inside the forward
    assert not any(m.training for m in model.modules()) and not model.__dict__["helper"].training


# --------------------------------------------------------------------------- clear errors


def test_no_trainable_parameters():
    with pytest.raises(ConfigError, match="no trainable parameter"):
        make_train_step(nn.Linear(3, 2).requires_grad_(False), F.cross_entropy, optim.sgd(0.1))


def test_loss_not_scalar():
    model = _mlp()
    opt = optim.sgd(0.1)
    step_fn = make_train_step(model, lambda o, t: F.cross_entropy(o, t, reduction="none"), opt)
    with pytest.raises(TrainingError, match="scalar.*reduction='mean'"):
        step_fn(TrainState.create(model, opt), _batch(0))


@pytest.mark.parametrize(
    "batch",
    [
        torch.randn(4, 10),
        (torch.randn(4, 10),),
        (torch.randn(4, 10), torch.zeros(4, dtype=torch.long), 1),
        {"x": torch.randn(4, 10), "y": torch.zeros(4, dtype=torch.long)},
        (torch.randn(4, 10), torch.zeros(5, dtype=torch.long)),
        (torch.randn(4, 10), 3),
        (torch.randn(0, 10), torch.zeros(0, dtype=torch.long)),
    ],
    ids=["tensor", "1-tuple", "3-tuple", "dict-keys", "sizes-differ", "int-targets", "empty"],
)
def test_wrong_batch_structure(batch):
    model = _mlp()
    opt = optim.sgd(0.1)
    with pytest.raises(TrainingError, match="batch|sample"):
        make_train_step(model, F.cross_entropy, opt)(TrainState.create(model, opt), batch)


def test_state_of_another_model():
    opt = optim.sgd(0.1)
    step_fn = make_train_step(_mlp(), F.cross_entropy, opt)
    with pytest.raises(TrainingError, match="does not match"):
        step_fn(TrainState.create(nn.Linear(10, 4), opt), _batch(0))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"on_nonfinite": "ignore"}, "on_nonfinite"),
        ({"precision": "fp8"}, "precision"),
        ({"precision": "bf16", "loss_scaling": LossScaling()}, "only used with precision='fp16'"),
        ({"precision": "fp16", "loss_scaling": LossScaling(growth_factor=0.5)}, "growth_factor"),
        ({"precision": "fp16", "loss_scaling": LossScaling(growth_interval=0)}, "growth_interval"),
        ({"accumulate": 0}, "accumulate"),
        ({"accumulate": 2.0}, "accumulate"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        make_train_step(_mlp(), F.cross_entropy, optim.sgd(0.1), **kwargs)


def _nan_loss(outputs, targets):
    return F.cross_entropy(outputs, targets) * float("nan")


def test_nan_loss_raises_with_step():
    model = _mlp()
    opt = optim.sgd(0.1)
    state = TrainState.create(model, opt).replace(step=torch.tensor(7))
    with pytest.raises(NonFiniteLossError, match="at step 7"):
        make_train_step(model, _nan_loss, opt)(state, _batch(0))


def test_nan_loss_skip_keeps_state():
    model = _mlp(batchnorm=True)
    opt = optim.sgd(0.1, momentum=0.9)
    state = TrainState.create(model, opt)
    new, metrics = make_train_step(model, _nan_loss, opt, on_nonfinite="skip")(state, _batch(0))
    assert metrics["nonfinite"] is True and metrics["skipped"] == 1
    assert int(new.step) == 1
    _assert_identical(new.replace(step=state.step), state)
    _, ok = make_train_step(model, F.cross_entropy, opt, on_nonfinite="skip")(state, _batch(0))
    assert ok["nonfinite"] is False and ok["skipped"] == 0


def test_benchmark_quick_runs():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "step_overhead.py"
    spec = importlib.util.spec_from_file_location("step_overhead", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--quick"])
    assert [(r["model"], r["optimizer"]) for r in rows] == [(m, o) for m in bench.MODELS for o in bench.OPTIMIZERS]
    assert all(r["ratio"] > 0 and r["donated_ratio"] > 0 for r in rows)


def test_first_step_does_not_import_dynamo():
    """A step's gradient is plain autograd: torch._dynamo (1.5-3 s to import) stays out of every worker's start."""
    import subprocess
    import sys

    code = (
        "import sys, torch, torch.nn.functional as F\n"
        "from raympi.core import optim\n"
        "from raympi.core.state import TrainState\n"
        "from raympi.core.step import make_train_step\n"
        "m = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))\n"
        "step = make_train_step(m, F.cross_entropy, optim.sgd(0.1))\n"
        "state, metrics = step(TrainState.create(m, optim.sgd(0.1)), "
        "(torch.randn(5, 2, 2), torch.randint(0, 3, (5,))))\n"
        "assert int(state.step) == 1 and metrics['samples'] == 5\n"
        "print('dynamo' if 'torch._dynamo' in sys.modules else 'clean')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clean"
