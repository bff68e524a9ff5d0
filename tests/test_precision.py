"""Mixed precision: bf16 against a hand-written autocast step, fp16 loss scaling against torch.amp.GradScaler."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raympi.core import optim
from raympi.core.precision import LossScaling
from raympi.core.state import TrainState
from raympi.core.step import make_train_step
from test_step import _run_ranks

torch.set_num_threads(1)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _mlp(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)


def _batch(step: int, n: int = 32, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 10, generator=g).to(device), torch.randint(0, 4, (n,), generator=g).to(device)


def _close(state: TrainState, ref: nn.Module, tol: float) -> None:
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), rtol=tol, atol=tol, msg=name)


OPTIMIZERS = {
    "sgd": (lambda: optim.sgd(0.05, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    "adam": (lambda: optim.adam(1e-3), lambda p: torch.optim.Adam(p, lr=1e-3)),
}


def _ours_and_torch(device: str, opt_name: str):
    """The same model twice: ``(model, our optimizer, our state, torch's copy, its torch.optim twin)``."""
    ours, theirs = OPTIMIZERS[opt_name]
    model = _mlp(device)
    opt = ours()
    ref = copy.deepcopy(model)
    return model, opt, TrainState.create(model, opt), ref, theirs(ref.parameters())


# --------------------------------------------------------------------------- bf16


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_bf16_step_matches_autocast_reference(device, opt_name):
    model, opt, state, ref, ref_opt = _ours_and_torch(device, opt_name)
    step_fn = make_train_step(model, F.cross_entropy, opt, precision="bf16")
    for step in range(3):
        x, y = _batch(step, device=device)
        state, metrics = step_fn(state, (x, y))
        with torch.autocast(device, dtype=torch.bfloat16):
            out = ref(x)
            loss = F.cross_entropy(out, y)
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
        assert out.dtype == torch.bfloat16
        assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-2)
        assert metrics["accuracy"] == (out.argmax(1) == y).float().mean().item()
    _close(state, ref, 2e-2)
    assert all(p.dtype == torch.float32 for p in state.params.values())  # float32 master weights
    assert state.loss_scale == {} and "loss_scale" not in metrics

    # The autocast is real: fp32 gives a different loss.
    fp32, m32 = make_train_step(model, F.cross_entropy, opt)(TrainState.create(model, opt), _batch(0, device=device))
    bf16, m16 = step_fn(TrainState.create(model, opt), _batch(0, device=device))
    assert m32["loss"] != m16["loss"]


# --------------------------------------------------------------------------- fp16 against GradScaler


class _Overflow:
    """A loss whose multiplier the test sets per step: 1e38 makes the scaled gradients overflow float32."""

    def __init__(self):
        self.mult = 1.0

    def __call__(self, outputs, targets):
        return F.cross_entropy(outputs, targets) * self.mult


OVERFLOW = {3, 4, 5, 40, 41, 97, 150, 151, 152, 153}  # loss * 1e38: scaled gradients are inf
INF_INPUT = {60, 130}  # an inf in the inputs: loss and gradients NaN
CFG = LossScaling(init_scale=2.0**14, growth_factor=2.0, backoff_factor=0.5, growth_interval=7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_fp16_200_steps_follow_gradscaler(device, opt_name):
    model, opt, state, ref, ref_opt = _ours_and_torch(
        device, opt_name
    )  # no scaler state yet: the first fp16 step makes it
    loss_fn = _Overflow()
    step_fn = make_train_step(model, loss_fn, opt, precision="fp16", loss_scaling=CFG)
    scaler = torch.amp.GradScaler(
        device,
        init_scale=CFG.init_scale,
        growth_factor=CFG.growth_factor,
        backoff_factor=CFG.backoff_factor,
        growth_interval=CFG.growth_interval,
    )
    scales, skipped, grew = [], [], 0
    for step in range(200):
        x, y = _batch(step, device=device)
        if step in INF_INPUT:
            x[0, 0] = float("inf")
        loss_fn.mult = 1e38 if step in OVERFLOW else 1.0
        used = scaler.get_scale()
        state, metrics = step_fn(state, (x, y))

        ref_opt.zero_grad()
        with torch.autocast(device, dtype=torch.float16):
            loss = loss_fn(ref(x), y)
        scaler.scale(loss).backward()
        scaler.step(ref_opt)
        scaler.update()

        assert metrics["loss_scale"] == used
        assert float(state.loss_scale["scale"]) == scaler.get_scale(), step
        assert int(state.loss_scale["growth_tracker"]) == scaler._get_growth_tracker(), step
        assert metrics["skipped"] == int(scaler.get_scale() < used), step
        if not metrics["skipped"]:
            assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-5)
        scales.append(scaler.get_scale())
        skipped.append(metrics["skipped"])
        grew += scaler.get_scale() > used
    # Every injected overflow is skipped; so are the scale's own overflows once it has grown too far.
    assert OVERFLOW | INF_INPUT <= {s for s, k in enumerate(skipped) if k}
    assert grew > 5 and min(scales) < CFG.init_scale < max(scales)  # both directions exercised
    assert int(state.step) == 200  # the loop's step advances on skipped steps...
    if opt_name == "adam":  # ...the optimizer's count does not, as torch.optim.Adam's under GradScaler
        assert int(state.opt_state.count) == 200 - sum(skipped)
        assert all(int(ref_opt.state[p]["step"]) == 200 - sum(skipped) for p in ref.parameters())
    _close(state, ref, 1e-5)


def test_fp16_skip_keeps_params_and_opt_state():
    model = _mlp()
    opt = optim.adam(1e-3)
    loss_fn = _Overflow()
    step_fn = make_train_step(model, loss_fn, opt, precision="fp16")
    state = TrainState.create(model, opt, loss_scaling=LossScaling())
    state, m = step_fn(state, _batch(0))
    assert m == {**m, "skipped": 0, "loss_scale": 2.0**16}
    loss_fn.mult = 1e38
    new, m = step_fn(state, _batch(1))
    assert m["skipped"] == 1 and m["loss_scale"] == 2.0**16
    assert new.params is state.params and new.opt_state is state.opt_state
    assert int(new.step) == 2 and float(new.loss_scale["scale"]) == 2.0**15
    assert int(new.loss_scale["growth_tracker"]) == 0


def test_fp16_overflow_on_one_rank_skips_on_all():
    """Rank 1's gradients overflow (its inputs hold an inf); both ranks skip and keep identical states."""
    models = [_mlp() for _ in range(2)]
    x, y = _batch(0, 16)

    def rank_main(rank: int, grad_sync):
        opt = optim.sgd(0.1)
        step_fn = make_train_step(models[rank], F.cross_entropy, opt, precision="fp16", grad_sync=grad_sync, rank=rank)
        state = TrainState.create(models[rank], opt)
        xs = x[rank * 8 : rank * 8 + 8].clone()
        if rank == 1:
            xs[0, 0] = float("inf")
        new, metrics = step_fn(state, (xs, y[rank * 8 : rank * 8 + 8]), 16)
        return state, new, metrics

    for state, new, metrics in _run_ranks(2, rank_main):
        assert metrics["skipped"] == 1
        assert all(torch.equal(new.params[k], state.params[k]) for k in state.params)
        assert float(new.loss_scale["scale"]) == 2.0**15


def test_fp16_matches_across_rank_splits():
    """Two ranks of an fp16 run equal one process on the global batch: scales, skips and parameters."""
    loss_fns = [_Overflow() for _ in range(3)]
    models = [_mlp() for _ in range(3)]
    total = 32

    def run(model, loss_fn, rank, grad_sync, lo, hi):
        opt = optim.sgd(0.05, momentum=0.9)
        step_fn = make_train_step(
            model, loss_fn, opt, precision="fp16", loss_scaling=CFG, grad_sync=grad_sync, rank=rank
        )
        state, history = TrainState.create(model, opt), []
        for step in range(30):
            loss_fn.mult = 1e38 if step in OVERFLOW else 1.0
            x, y = _batch(step, total)
            state, metrics = step_fn(state, (x[lo:hi], y[lo:hi]), total)
            history.append((metrics["skipped"], metrics["loss_scale"]))
        return state, history

    single, single_hist = run(models[2], loss_fns[2], 0, None, 0, total)
    for state, history in _run_ranks(2, lambda r, sync: run(models[r], loss_fns[r], r, sync, r * 13, 13 + r * 19)):
        assert history == single_hist
        for k in single.params:
            # fp16 rounds a rank's partial gradient sums, not only the total: fp16 tolerance.
            torch.testing.assert_close(state.params[k], single.params[k], rtol=5e-3, atol=5e-3)


def test_fp16_scaler_state_survives_a_checkpoint(tmp_path):
    """Save mid-run, load with weights_only, continue: the same run as without the interruption."""
    model = _mlp()
    opt = optim.adam(1e-3)
    loss_fn = _Overflow()
    step_fn = make_train_step(model, loss_fn, opt, precision="fp16", loss_scaling=CFG)

    def steps(state, lo, hi):
        for step in range(lo, hi):
            loss_fn.mult = 1e38 if step in OVERFLOW else 1.0
            state, _ = step_fn(state, _batch(step))
        return state

    straight = steps(TrainState.create(model, opt), 0, 14)
    half = steps(TrainState.create(model, opt), 0, 8)
    assert float(half.loss_scale["scale"]) < CFG.init_scale and int(half.loss_scale["growth_tracker"]) > 0
    torch.save(half.to_dict(), tmp_path / "ckpt.pt")
    resumed = steps(TrainState.from_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True)), 8, 14)
    assert float(resumed.loss_scale["scale"]) == float(straight.loss_scale["scale"])
    assert all(torch.equal(resumed.params[k], straight.params[k]) for k in straight.params)


def test_native_bf16_is_read_from_the_cpu_flags():
    from raympi.core.precision import cpu_has_native_bf16

    assert cpu_has_native_bf16("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert cpu_has_native_bf16("flags\t\t: fpu avx2 amx_bf16 amx_tile\n")
    assert not cpu_has_native_bf16("processor\t: 0\nflags\t\t: fpu sse4_2 avx2 avx512f avx512bw\n")
    assert cpu_has_native_bf16("no flags line at all\n")  # unknown: no warning without evidence
