"""raympi.optim against its torch.optim twins, on a small model, step for step."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad

from raympi.core import optim, pytree

torch.set_num_threads(1)

STEPS = 200


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(12, 6, generator=g), torch.randn(12, 3, generator=g)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _run_pair(
    ours: optim.GradientTransformation, make_torch, steps: int = STEPS, clip=None, sched=None, fused=True
):
    """Train two copies of one model for ``steps`` steps; return both parameter dicts.

    ``fused``: step with ``apply_gradients`` (the path ``train_step`` takes),
    else with ``update`` + ``apply_updates``.
    """
    ref = _model()
    torch_opt = make_torch(ref.parameters())
    scheduler = sched(torch_opt) if sched else None
    template = _model()
    params = {n: p.detach().clone() for n, p in template.named_parameters()}
    state = ours.init(params)

    def loss(p, x, y):
        return F.mse_loss(functional_call(template, p, (x,)), y)

    for step in range(steps):
        x, y = _data(step)
        torch_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        torch_opt.step()
        if scheduler:
            scheduler.step()

        grads = grad(loss)(params, x, y)
        if fused:
            params, state = optim.apply_gradients(ours, grads, state, params)
        else:
            updates, state = ours.update(grads, state, params)
            params = optim.apply_updates(params, updates)
    return params, dict(ref.named_parameters())


CASES = {
    "sgd": (optim.sgd(0.05), lambda p: torch.optim.SGD(p, lr=0.05)),
    "sgd_momentum": (optim.sgd(0.05, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    "sgd_nesterov_wd": (
        optim.sgd(0.01, momentum=0.9, nesterov=True, weight_decay=1e-2),
        lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-2),
    ),
    "adam": (optim.adam(1e-2), lambda p: torch.optim.Adam(p, lr=1e-2)),
    "adam_l2": (
        optim.adam(1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2),
        lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2),
    ),
    "adamw": (optim.adamw(1e-2, weight_decay=0.1), lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),
    "from_torch_rmsprop": (
        optim.from_torch(torch.optim.RMSprop, lr=1e-3, alpha=0.9, momentum=0.5),
        lambda p: torch.optim.RMSprop(p, lr=1e-3, alpha=0.9, momentum=0.5),
    ),
}


# The learning rates keep torch itself well conditioned: with SGD at lr 0.05,
# momentum 0.9 and Nesterov, nudging every initial weight by one float32 ulp
# already moves torch's own result by 1.4e-6 after 200 steps, so no second
# implementation could be told apart from torch at 1e-6 there.
@pytest.mark.parametrize("fused", [True, False], ids=["apply_gradients", "update"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_torch_optim(name, fused):
    ours, make_torch = CASES[name]
    params, ref = _run_pair(ours, make_torch, fused=fused)
    start = _model().state_dict()
    for n in ref:
        assert _rel_err(params[n], ref[n].detach()) < 1e-6, n
        assert _rel_err(params[n], start[n]) > 1e-3, "parameters did not move"


def test_clip_by_global_norm_matches_clip_grad_norm():
    ours = optim.chain(optim.clip_by_global_norm(0.1), optim.sgd(0.05, momentum=0.9))
    params, ref = _run_pair(ours, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), steps=50, clip=0.1)
    for n in ref:
        assert _rel_err(params[n], ref[n].detach()) < 1e-6, n


def test_schedule_matches_lambda_lr():
    lr = optim.linear_warmup(10, optim.cosine_decay(0.05, 40, alpha=0.1))
    params, ref = _run_pair(
        optim.sgd(lr, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=1.0, momentum=0.9),
        steps=60,
        sched=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lr),
    )
    for n in ref:
        assert _rel_err(params[n], ref[n].detach()) < 1e-6, n


def test_from_torch_schedule_and_state_shape():
    opt = optim.from_torch(torch.optim.Adam, lr=optim.constant(1e-2))
    params = {"w": torch.ones(3)}
    state = opt.init(params)
    assert state["state"] == {}  # torch creates its state lazily
    _, state = opt.update({"w": torch.ones(3)}, state, params)
    assert set(state["state"]["w"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert int(state["count"]) == 1


@pytest.mark.parametrize("name", list(CASES))
def test_update_and_apply_gradients_are_pure(name):
    opt = CASES[name][0]
    params = {"a": torch.randn(4, 3), "b": torch.randn(3)}
    grads = {"a": torch.randn(4, 3), "b": torch.randn(3)}
    state = opt.init(params)
    for _ in range(2):  # the second round starts from a non-trivial state
        snapshot = [t.clone() for t in pytree.tensor_leaves((params, grads, state))]
        updates, new_state = opt.update(grads, state, params)
        new_params, fused_state = optim.apply_gradients(opt, grads, state, params)
        after = pytree.tensor_leaves((params, grads, state))
        assert all(torch.equal(a, b) for a, b in zip(snapshot, after))
        again, _ = opt.update(grads, state, params)
        assert all(torch.equal(a, b) for a, b in zip(pytree.leaves(updates), pytree.leaves(again)))
        # The two paths agree to rounding and produce the same state.
        for a, b in zip(pytree.leaves(new_params), pytree.leaves(optim.apply_updates(params, updates))):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert all(torch.equal(a, b) for a, b in zip(pytree.leaves(new_state), pytree.leaves(fused_state)))
        state, params = new_state, new_params


def test_state_survives_torch_save(tmp_path):
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(optim.cosine_decay(1e-3, 10)))
    params = {"w": torch.randn(3)}
    _, state = opt.update({"w": torch.randn(3)}, opt.init(params), params)
    torch.save(state, tmp_path / "s.pt")
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)
    leaves, spec = pytree.flatten(state)
    assert spec == pytree.flatten(loaded)[1]
    assert all(torch.equal(a, b) for a, b in zip(leaves, pytree.leaves(loaded)))


def test_schedules():
    assert optim.constant(0.3)(10_000) == 0.3
    cos = optim.cosine_decay(1.0, 100, alpha=0.1)
    assert cos(0) == 1.0 and math.isclose(cos(100), 0.1) and math.isclose(cos(500), 0.1)
    assert math.isclose(cos(50), 0.55)
    warm = optim.linear_warmup(10, 0.5)
    assert [warm(k) for k in (0, 5, 10, 99)] == [0.0, 0.25, 0.5, 0.5]
    chained = optim.linear_warmup(10, cos, init_value=0.1)
    assert chained(0) == 0.1 and chained(10) == 1.0 and math.isclose(chained(60), 0.55)


def test_bad_arguments():
    with pytest.raises(ValueError):
        optim.sgd(-1.0)
    with pytest.raises(ValueError):
        optim.sgd(0.1, nesterov=True)
    with pytest.raises(ValueError):
        optim.clip_by_global_norm(0)
    with pytest.raises(TypeError):
        optim.from_torch(nn.Linear)


@pytest.mark.parametrize("name", ["sgd", "sgd_momentum", "sgd_nesterov_wd", "adam", "adam_l2", "adamw", "chain"])
def test_donated_step_equals_pure_step_in_place(name):
    opt = optim.chain(optim.clip_by_global_norm(0.5), optim.adam(1e-2)) if name == "chain" else CASES[name][0]
    params = {"a": torch.randn(4, 3), "b": torch.randn(3)}
    state = opt.init(params)
    for step in range(3):
        grads = {"a": torch.randn(4, 3), "b": torch.randn(3)}
        pure_params, pure_state = optim.apply_gradients(opt, grads, state, params)
        ptrs = [t.data_ptr() for t in pytree.tensor_leaves((params, state)) if t.numel() > 1]
        params, state = optim.apply_gradients(opt, grads, state, params, donate=True)
        for ours, pure in ((params, pure_params), (state, pure_state)):
            assert all(torch.equal(a, b) for a, b in zip(pytree.leaves(ours), pytree.leaves(pure)))
        # Parameters and moment buffers were written where the old ones lived.
        assert ptrs == [t.data_ptr() for t in pytree.tensor_leaves((params, state)) if t.numel() > 1]


# --------------------------------------------------------------------------- building blocks

_SCHED = optim.linear_warmup(5, optim.cosine_decay(1e-2, 25, alpha=0.1))
CHAINS = {
    "adam": (
        optim.chain(optim.scale_by_adam(), optim.scale_by_learning_rate(1e-2)),
        optim.adam(1e-2),
        lambda p: torch.optim.Adam(p, lr=1e-2),
        None,
    ),
    # Decay after the Adam scaling and before the -lr: -lr * (adam + wd * p),
    # which is AdamW's p *= 1 - lr * wd followed by the Adam step.  torch rounds
    # 1 - lr * wd to float32 each step: ~7e-7 apart after 30 steps, 3e-6 after 200.
    "adamw": (
        optim.chain(optim.scale_by_adam(), optim.add_decayed_weights(0.1), optim.scale_by_learning_rate(1e-2)),
        optim.adamw(1e-2, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        None,
    ),
    "adamw_schedule": (
        optim.chain(
            optim.scale_by_adam(b1=0.8, b2=0.99, eps=1e-6),
            optim.add_decayed_weights(0.1),
            optim.scale_by_learning_rate(_SCHED),
        ),
        optim.adamw(_SCHED, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=1.0, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, _SCHED),
    ),
}


@pytest.mark.parametrize("fused", [True, False], ids=["apply_gradients", "update"])
@pytest.mark.parametrize("name", list(CHAINS))
def test_chain_of_building_blocks_matches_alias_and_torch(name, fused):
    chained, alias, make_torch, sched = CHAINS[name]
    params, ref = _run_pair(chained, make_torch, steps=30, sched=sched, fused=fused)
    alias_params, _ = _run_pair(alias, make_torch, steps=30, sched=sched)
    start = _model().state_dict()
    for n in ref:
        assert _rel_err(params[n], alias_params[n]) < 1e-6, n
        assert _rel_err(params[n], ref[n].detach()) < 1e-6, n
        assert _rel_err(params[n], start[n]) > 1e-3, "parameters did not move"


def test_building_blocks_state_and_purity():
    opt = CHAINS["adamw"][0]
    params = {"a": torch.randn(4, 3), "b": torch.randn(3)}
    grads = {"a": torch.randn(4, 3), "b": torch.randn(3)}
    state = opt.init(params)
    assert set(state[0]) == {"count", "mu", "nu"} and state[1] == {} and set(state[2]) == {"count"}
    snapshot = [t.clone() for t in pytree.tensor_leaves((params, grads, state))]
    _, new_state = opt.update(grads, state, params)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, pytree.tensor_leaves((params, grads, state))))
    assert int(new_state[0]["count"]) == 1 and int(new_state[2]["count"]) == 1
    # The first Adam step is g / (|g| + eps): all updates of magnitude ~1.
    updates, _ = optim.scale_by_adam().update(grads, optim.scale_by_adam().init(params))
    torch.testing.assert_close(updates["a"], grads["a"].sign(), rtol=1e-6, atol=1e-6)
    lr_updates, _ = optim.scale_by_learning_rate(lambda k: 0.5).update(grads, {"count": torch.tensor(3)})
    torch.testing.assert_close(lr_updates["b"], -0.5 * grads["b"])


def test_building_blocks_bad_arguments():
    with pytest.raises(ValueError):
        optim.scale_by_adam(b1=1.0)
    with pytest.raises(ValueError):
        optim.scale_by_learning_rate(-1e-3)
    with pytest.raises(ValueError):
        optim.add_decayed_weights(-0.1)
    wd = optim.add_decayed_weights(0.1)
    with pytest.raises(ValueError):
        wd.update({"w": torch.ones(2)}, wd.init({"w": torch.ones(2)}))
