"""Gradient accumulation: k micro-batches per rank give the unaccumulated update, with one grad_sync per step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raympi.core import optim
from raympi.core.accumulate import micro_batches
from raympi.core.precision import LossScaling
from raympi.core.state import TrainState
from raympi.core.step import make_train_step
from test_step import TwoInputs, _run_ranks

torch.set_num_threads(1)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 10, generator=g), torch.randint(0, 4, (n,), generator=g)


def _train(sizes: list[int], accumulate: int, steps: int, precision: str = "fp32", loss_fn=F.cross_entropy):
    """Train on global batches split over ``len(sizes)`` simulated ranks; count the grad_sync calls."""
    world, total = len(sizes), sum(sizes)
    models = [_mlp() for _ in range(world)]
    calls = [0] * world

    def rank_main(rank: int, grad_sync):
        def counted(tree):
            calls[rank] += 1
            return grad_sync(tree)

        opt = optim.adam(1e-2)
        scaling = LossScaling(init_scale=2.0**10, growth_interval=5) if precision == "fp16" else None
        step_fn = make_train_step(
            models[rank],
            loss_fn,
            opt,
            grad_sync=counted,
            rank=rank,
            accumulate=accumulate,
            precision=precision,
            loss_scaling=scaling,
        )
        state, history = TrainState.create(models[rank], opt), []
        lo = sum(sizes[:rank])
        for step in range(steps):
            if hasattr(loss_fn, "step"):
                loss_fn.step = step
            x, y = _batch(step, total)
            state, metrics = step_fn(state, (x[lo : lo + sizes[rank]], y[lo : lo + sizes[rank]]), total)
            history.append(metrics)
        return state, history

    results = _run_ranks(world, rank_main)
    assert calls == [steps] * world  # one cross-rank sum per step, whatever accumulate
    return results


def _assert_same_run(a, b, tol: float) -> None:
    (sa, ha), (sb, hb) = a, b
    for k in sa.params:
        torch.testing.assert_close(sa.params[k], sb.params[k], rtol=tol, atol=tol, msg=k)
    for ma, mb in zip(ha, hb):
        assert ma.keys() == mb.keys()
        assert ma["samples"] == mb["samples"]
        assert ma["loss"] == pytest.approx(mb["loss"], rel=tol)
        assert ma.get("accuracy") == mb.get("accuracy")
        assert ma.get("skipped") == mb.get("skipped") and ma.get("loss_scale") == mb.get("loss_scale")


def test_accumulate_4_equals_accumulate_1_over_two_ranks():
    """50 steps, global batch 64 split 37 + 27 (micro-batches 10, 9, 9, 9 and 7, 7, 7, 6)."""
    one = _train([37, 27], accumulate=1, steps=50)
    four = _train([37, 27], accumulate=4, steps=50)
    assert four[0][1] == four[1][1]  # every rank sees the same global metrics
    _assert_same_run(four[0], one[0], 1e-5)
    _assert_same_run(four[1], one[1], 1e-5)


def test_accumulate_more_than_the_batch_uses_one_sample_each():
    _assert_same_run(_train([3, 2], accumulate=8, steps=5)[0], _train([3, 2], accumulate=1, steps=5)[0], 1e-5)


def test_accumulate_with_bf16():
    _assert_same_run(
        _train([20, 12], accumulate=3, steps=10, precision="bf16")[0],
        _train([20, 12], accumulate=1, steps=10, precision="bf16")[0],
        2e-2,
    )


class _OverflowAt:
    def __init__(self, steps: set[int]):
        self.steps, self.step = steps, 0

    def __call__(self, outputs, targets):
        return F.cross_entropy(outputs, targets) * (1e38 if self.step in self.steps else 1.0)


def test_accumulate_with_fp16_same_scales_and_skips():
    runs = [_train([20, 12], accumulate=k, steps=20, precision="fp16", loss_fn=_OverflowAt({2, 9, 10})) for k in (1, 3)]
    one, three = (r[0] for r in runs)
    assert [m["skipped"] for m in three[1]] == [int(s in {2, 9, 10}) for s in range(20)]
    scales = [m["loss_scale"] for m in three[1]]
    assert any(b > a for a, b in zip(scales, scales[1:]))  # it grew too
    _assert_same_run(three, one, 5e-3)  # fp16 rounds each micro-batch's gradient


def test_micro_batches_split_batched_inputs_only():
    x, y = _batch(0, 10)
    scale = torch.tensor(2.0)
    table = torch.randn(7, 3)  # another first dimension: not batched
    micro = micro_batches((x, scale), {"table": table, "mask": x > 0}, y, 10, 3)
    assert [m[3] for m in micro] == [4, 3, 3]
    assert torch.equal(torch.cat([m[2] for m in micro]), y)
    assert torch.equal(torch.cat([m[0][0] for m in micro]), x)
    assert all(m[0][1] is scale and m[1]["table"] is table for m in micro)
    assert torch.equal(torch.cat([m[1]["mask"] for m in micro]), x > 0)


def test_accumulate_with_tuple_inputs():
    torch.manual_seed(0)
    model = TwoInputs()
    opt = optim.sgd(0.1, momentum=0.9)
    x, y = _batch(0, 11)
    batch = ((x, torch.tensor(2.0)), y)
    states = []
    for k in (1, 4):
        state = TrainState.create(model, opt)
        step_fn = make_train_step(model, F.cross_entropy, opt, accumulate=k)
        for _ in range(3):
            state, metrics = step_fn(state, batch)
        states.append((state, metrics))
    for name in states[0][0].params:
        torch.testing.assert_close(states[1][0].params[name], states[0][0].params[name], rtol=1e-5, atol=1e-6)
    assert states[1][1]["samples"] == 11 and states[1][1]["accuracy"] == states[0][1]["accuracy"]
