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
    ours: optim.GradientTransformation, make_torch, steps: int = STEPS, clip=None, sched=None, fused=True, model=_model
):
    """Train two copies of one model for ``steps`` steps; return both parameter dicts.

    ``fused``: step with ``apply_gradients`` (the path ``train_step`` takes),
    else with ``update`` + ``apply_updates``.
    """
    ref = model()
    torch_opt = make_torch(ref.parameters())
    scheduler = sched(torch_opt) if sched else None
    template = model()
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
    assert type(state) is optim.FromTorchState and state.state == {}  # torch creates its state lazily
    _, state = opt.update({"w": torch.ones(3)}, state, params)
    assert set(state.state["w"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert int(state.count) == 1


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
    assert (
        state[0]._fields == ("count", "mu", "nu") and state[1] == optim.EmptyState() and state[2]._fields == ("count",)
    )
    snapshot = [t.clone() for t in pytree.tensor_leaves((params, grads, state))]
    _, new_state = opt.update(grads, state, params)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, pytree.tensor_leaves((params, grads, state))))
    assert int(new_state[0].count) == 1 and int(new_state[2].count) == 1
    # The first Adam step is g / (|g| + eps): all updates of magnitude ~1.
    updates, _ = optim.scale_by_adam().update(grads, optim.scale_by_adam().init(params))
    torch.testing.assert_close(updates["a"], grads["a"].sign(), rtol=1e-6, atol=1e-6)
    lr_updates, _ = optim.scale_by_learning_rate(lambda k: 0.5).update(
        grads, optim.ScaleByScheduleState(torch.tensor(3))
    )
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


# --------------------------------------------------------------------------- wrappers


def _ln_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))


def _decay(params):
    """Weight decay on the matrices only: not on biases and LayerNorm parameters."""
    return {n: p.ndim >= 2 for n, p in params.items()}


def _torch_groups(model, select, selected: dict, others: dict):
    """``make_torch``'s argument as two torch parameter groups: ``select(name, p)`` picks the first."""
    names = [n for n, _ in model().named_parameters()]

    def groups(ps):
        ps = list(ps)
        return [
            {"params": [p for n, p in zip(names, ps) if select(n, p)], **selected},
            {"params": [p for n, p in zip(names, ps) if not select(n, p)], **others},
        ]

    return groups


def _assert_matches(params, ref, model=_model, tol=1e-6, moved=True):
    start = model().state_dict()
    for n in ref:
        assert _rel_err(params[n], ref[n].detach()) < tol, n
        if moved:
            assert _rel_err(params[n], start[n]) > 1e-3, f"{n} did not move"


# torch.optim.AdamW decays p *= 1 - lr * wd before its Adam step: the same as adding wd * p to the
# Adam direction before the -lr, so the mask goes *between* scale_by_adam and the learning rate
# (in front of scale_by_adam it would be Adam's L2 decay of the gradient).  lr and wd are powers of
# two so that torch's float32 rounding of 1 - lr * wd, which the chain does not share, is exact: with
# lr=1e-2, wd=0.1 that rounding alone moves the two apart by ~1e-6 in 40 steps (the fused
# adamw(mask=...) does torch's arithmetic and agrees to the bit either way).
_LR, _WD = 2**-7, 2**-3
MASKED_ADAMW = {
    "chain": optim.chain(
        optim.scale_by_adam(), optim.masked(optim.add_decayed_weights(_WD), _decay), optim.scale_by_learning_rate(_LR)
    ),
    "adamw_mask": optim.adamw(_LR, weight_decay=_WD, mask=_decay),
}


@pytest.mark.parametrize("fused", [True, False], ids=["apply_gradients", "update"])
@pytest.mark.parametrize("name", list(MASKED_ADAMW))
def test_masked_weight_decay_matches_torch_adamw_with_two_groups(name, fused):
    groups = _torch_groups(_ln_model, lambda n, p: p.ndim >= 2, {"weight_decay": _WD}, {"weight_decay": 0.0})
    make_torch = lambda ps: torch.optim.AdamW(groups(ps), lr=_LR)  # noqa: E731
    params, ref = _run_pair(MASKED_ADAMW[name], make_torch, steps=40, fused=fused, model=_ln_model)
    _assert_matches(params, ref, _ln_model)
    # The mask matters: decaying everything lands far from torch's two groups.
    everything, _ = _run_pair(optim.adamw(_LR, weight_decay=_WD), make_torch, steps=40, model=_ln_model)
    assert max(_rel_err(everything[n], ref[n].detach()) for n in ref) > 1e-3


def _head(name: str) -> bool:
    return name.startswith("2.")  # the last Linear of _model


def _head_labels(params):
    return {n: "head" if _head(n) else "body" for n in params}


MULTI = {
    "adam": (
        optim.multi_transform({"body": optim.adam(1e-3), "head": optim.adam(1e-2)}, _head_labels),
        lambda groups: torch.optim.Adam(groups, lr=1e-3),
        {"lr": 1e-2},
    ),
    "sgd_momentum": (
        optim.multi_transform(
            {"body": optim.sgd(0.01, momentum=0.9), "head": optim.sgd(0.1, momentum=0.9)}, _head_labels
        ),
        lambda groups: torch.optim.SGD(groups, lr=0.01, momentum=0.9),
        {"lr": 0.1},
    ),
}


@pytest.mark.parametrize("fused", [True, False], ids=["apply_gradients", "update"])
@pytest.mark.parametrize("name", list(MULTI))
def test_multi_transform_head_lr_matches_torch_param_groups(name, fused):
    ours, make_torch, head_opts = MULTI[name]
    groups = _torch_groups(_model, lambda n, p: _head(n), head_opts, {})
    params, ref = _run_pair(ours, lambda ps: make_torch(groups(ps)), steps=60, fused=fused)
    _assert_matches(params, ref)


@pytest.mark.parametrize("fused", [True, False], ids=["apply_gradients", "update"])
def test_set_to_zero_freezes(fused):
    labels = {n: "frozen" if n.startswith("0.") else "train" for n, _ in _model().named_parameters()}
    ours = optim.multi_transform({"train": optim.sgd(0.05, momentum=0.9), "frozen": optim.set_to_zero()}, labels)
    names = list(labels)

    def make_torch(ps):  # frozen parameters are left out of torch's optimizer
        return torch.optim.SGD([p for n, p in zip(names, ps) if labels[n] == "train"], lr=0.05, momentum=0.9)

    params, ref = _run_pair(ours, make_torch, steps=30, fused=fused)
    start = _model().state_dict()
    for n in ref:
        if labels[n] == "frozen":
            assert torch.equal(params[n], start[n]) and torch.equal(ref[n].detach(), start[n]), n
        else:
            assert _rel_err(params[n], ref[n].detach()) < 1e-6 and _rel_err(params[n], start[n]) > 1e-3, n
    state = ours.init({n: p.detach() for n, p in _model().named_parameters()})
    assert set(state.inner_states["train"].trace) == {n for n in names if labels[n] == "train"}


def _grads(step: int, params, bad: bool = False):
    g = torch.Generator().manual_seed(step)
    grads = {n: torch.randn(p.shape, generator=g) for n, p in params.items()}
    if bad:
        grads["b"][1] = float("nan")
    return grads


def _start():
    g = torch.Generator().manual_seed(7)
    return {"a": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


_SCHED2 = optim.linear_warmup(3, optim.cosine_decay(1e-2, 10))


@pytest.mark.parametrize("fused", [True, False], ids=["apply_gradients", "update"])
def test_inject_hyperparams_equals_plain_optimizer_and_reports_the_schedule(fused):
    injected = optim.chain(
        optim.clip_by_global_norm(1.0), optim.inject_hyperparams(optim.adamw)(lr=_SCHED2, weight_decay=0.1)
    )
    plain = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(_SCHED2, weight_decay=0.1))
    p1 = p2 = _start()
    s1, s2 = injected.init(p1), plain.init(p2)
    assert optim.current_hyperparams(s1) == {"lr": _SCHED2(0), "weight_decay": 0.1}
    for step in range(15):
        grads = _grads(step, p1)
        if fused:
            p1, s1 = optim.apply_gradients(injected, grads, s1, p1)
        else:
            u, s1 = injected.update(grads, s1, p1)
            p1 = optim.apply_updates(p1, u)
        p2, s2 = optim.apply_gradients(plain, grads, s2, p2)
        if fused:  # the very same arithmetic
            assert all(torch.equal(p1[n], p2[n]) for n in p1)
        else:
            assert all(_rel_err(p1[n], p2[n]) < 1e-6 for n in p1)
        assert all(torch.equal(a, b) for a, b in zip(pytree.leaves(s1[1].inner_state), pytree.leaves(s2[1])))
        assert optim.current_hyperparams(s1) == {"lr": _SCHED2(step), "weight_decay": 0.1}
    assert optim.current_hyperparams(s2) == {}


def test_inject_hyperparams_numbers_live_in_the_state():
    opt = optim.inject_hyperparams(optim.sgd)(0.1, momentum=0.9, nesterov=True)
    params = _start()
    state = opt.init(params)
    assert set(state.hyperparams) == {"lr", "momentum"}  # nesterov (a bool) is static
    assert set(optim.inject_hyperparams(optim.adamw)(lr=_SCHED2, mask=_decay).init(params).hyperparams) == {"lr"}
    params, state = optim.apply_gradients(opt, _grads(0, params), state, params)
    state.hyperparams["lr"] = torch.tensor(0.0, dtype=torch.float64)  # overwritten: the next step is void
    frozen, _ = optim.apply_gradients(opt, _grads(1, params), state, params)
    assert all(torch.equal(frozen[n], params[n]) for n in params)
    # **kwargs factories: from_torch's class stays static, its numbers are injected.
    rms = optim.inject_hyperparams(optim.from_torch)(torch.optim.RMSprop, lr=_SCHED2, alpha=0.9)
    s = rms.init(params)
    for step in range(4):
        _, s = rms.update(_grads(step, params), s, params)
    assert optim.current_hyperparams(s) == {"lr": _SCHED2(3), "alpha": 0.9}
    # Two injected optimizers: the names are qualified by their place in the state.
    two = optim.multi_transform(
        {"body": optim.inject_hyperparams(optim.adam)(lr=1e-3), "head": optim.inject_hyperparams(optim.adam)(lr=1e-2)},
        lambda p: {n: "head" if n == "b" else "body" for n in p},
    )
    assert optim.current_hyperparams(two.init(params)) == {"inner_states/body/lr": 1e-3, "inner_states/head/lr": 1e-2}


@pytest.mark.parametrize("debias", [False, True])
@pytest.mark.parametrize("fused", [True, False], ids=["apply_gradients", "update"])
def test_ema_of_params_equals_hand_computed(fused, debias):
    decay = 0.8
    opt = optim.chain(optim.sgd(0.05, momentum=0.9), optim.ema(decay, debias=debias))
    params = _start()
    state = opt.init(params)
    assert all(torch.equal(optim.ema_params(state)[n], params[n]) for n in params)
    hand = {n: torch.zeros_like(p) if debias else p.clone() for n, p in params.items()}
    for step in range(1, 21):
        if fused:
            params, state = optim.apply_gradients(opt, _grads(step, params), state, params)
        else:
            u, state = opt.update(_grads(step, params), state, params)
            params = optim.apply_updates(params, u)
        hand = {n: decay * hand[n] + (1 - decay) * params[n] for n in params}
        expected = {n: hand[n] / (1 - decay**step) for n in hand} if debias else hand
        for n in params:
            torch.testing.assert_close(optim.ema_params(state)[n], expected[n], rtol=1e-6, atol=1e-6)
    assert _rel_err(optim.ema_params(state)["a"], params["a"]) > 1e-3  # an average, not the last parameters
    assert optim.ema_params(optim.adam().init(params)) is None


@pytest.mark.parametrize("fused", [True, False], ids=["apply_gradients", "update"])
def test_apply_if_finite_skips_nonfinite_steps(fused):
    guarded = optim.apply_if_finite(optim.adam(1e-2), max_consecutive_errors=2)
    plain = optim.adam(1e-2)

    def step(opt, grads, state, params):
        if fused:
            return optim.apply_gradients(opt, grads, state, params)
        u, state = opt.update(grads, state, params)
        return optim.apply_updates(params, u), state

    p1 = p2 = _start()
    s1, s2 = guarded.init(p1), plain.init(p2)
    bad_steps = {3, 6, 7, 8}
    for k in range(9):
        before = p1
        p1, s1 = step(guarded, _grads(k, p1, bad=k in bad_steps), s1, p1)
        if k in (3, 6, 7):  # skipped: parameters and Adam's state as they were
            assert all(torch.equal(p1[n], before[n]) for n in p1)
            assert all(torch.equal(a, b) for a, b in zip(pytree.leaves(s1.inner_state), pytree.leaves(s2)))
        elif k == 8:  # a third non-finite step in a row is applied (max_consecutive_errors=2)
            assert torch.isnan(p1["b"]).any() and int(s1.inner_state.count) == 6
        else:
            p2, s2 = step(plain, _grads(k, p2), s2, p2)
            assert all(torch.equal(p1[n], p2[n]) for n in p1)
        expected = {3: (1, False, 1), 4: (0, True, 1), 6: (1, False, 2), 7: (2, False, 3), 8: (3, False, 4)}
        streak, last, total = expected.get(k, (0, True, 1 if 3 < k < 6 else 0))
        assert int(s1.notfinite_count) == streak and bool(s1.last_finite) == last
        assert int(s1.total_notfinite) == total


WRAPPED = {
    "chain_adamw": optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(optim.cosine_decay(1e-3, 10))),
    "masked": optim.chain(
        optim.scale_by_adam(), optim.masked(optim.add_decayed_weights(0.1), _decay), optim.scale_by_learning_rate(1e-2)
    ),
    "adamw_mask": optim.adamw(1e-2, mask=_decay),
    "masked_fused_inner": optim.masked(optim.adam(1e-2), {"a": True, "b": False}),
    "masked_none": optim.masked(optim.adam(1e-2), lambda p: {n: False for n in p}),
    "multi_transform": optim.multi_transform(
        {"x": optim.sgd(0.1, momentum=0.9), "y": optim.set_to_zero()}, {"a": "x", "b": "y"}
    ),
    "inject": optim.inject_hyperparams(optim.adamw)(lr=_SCHED2, weight_decay=0.1, mask=_decay),
    "adamw_mask_none": optim.adamw(1e-2, mask={"a": False, "b": False}),
    "ema": optim.chain(optim.adam(1e-2), optim.ema(0.9, debias=True)),
    "apply_if_finite": optim.apply_if_finite(optim.sgd(0.1, momentum=0.9)),
}


@pytest.mark.parametrize("name", list(WRAPPED))
def test_state_survives_torch_save(name, tmp_path):
    opt = WRAPPED[name]
    params = _start()
    state = opt.init(params)
    for k in range(2):  # for apply_if_finite, the second step is skipped
        _, state = opt.update(_grads(k, params, bad=name == "apply_if_finite" and k == 1), state, params)
    torch.save(state, tmp_path / "s.pt")
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)
    leaves, spec = pytree.flatten(state)
    assert spec == pytree.flatten(loaded)[1]
    assert all(type(x) is torch.Tensor for x in leaves)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(leaves, pytree.leaves(loaded)))
    # and the loaded state steps on exactly as the original
    again, expected = opt.update(_grads(5, params), loaded, params), opt.update(_grads(5, params), state, params)
    assert all(torch.equal(a, b) for a, b in zip(pytree.leaves(again), pytree.leaves(expected)))


@pytest.mark.parametrize("name", list(WRAPPED))
def test_wrappers_pure_and_donated(name):
    opt = WRAPPED[name]
    params = _start()
    state = opt.init(params)
    for k in range(3):
        grads = _grads(k, params)
        snapshot = [t.clone() for t in pytree.tensor_leaves((params, grads, state))]
        updates, new_state = opt.update(grads, state, params)
        pure_params, pure_state = optim.apply_gradients(opt, grads, state, params)
        assert all(torch.equal(a, b) for a, b in zip(snapshot, pytree.tensor_leaves((params, grads, state))))
        for a, b in zip(pytree.leaves(pure_params), pytree.leaves(optim.apply_updates(params, updates))):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert all(torch.equal(a, b) for a, b in zip(pytree.leaves(new_state), pytree.leaves(pure_state)))
        # A chain donates only its last transformation's state (scale_by_adam and adam run unfused before
        # masked and ema): there, only the parameters are written in place.
        in_place = (params,) if name in ("masked", "ema") else (params, state)
        ptrs = [t.data_ptr() for t in pytree.tensor_leaves(in_place) if t.numel() > 1]
        params, state = optim.apply_gradients(opt, grads, state, params, donate=True)
        pure = pytree.leaves((pure_params, pure_state))
        assert all(torch.equal(a, b) for a, b in zip(pytree.leaves((params, state)), pure))
        in_place = (params,) if name in ("masked", "ema") else (params, state)
        assert ptrs == [t.data_ptr() for t in pytree.tensor_leaves(in_place) if t.numel() > 1]


def test_wrappers_bad_arguments():
    params = _start()
    with pytest.raises(ValueError, match="no entry for parameter"):
        optim.masked(optim.sgd(0.1), {"a": True}).init(params)
    with pytest.raises(ValueError, match="has no transformation"):
        optim.multi_transform({"x": optim.sgd(0.1)}, {"a": "x", "b": "z"}).init(params)
    with pytest.raises(TypeError):
        optim.multi_transform({0: optim.sgd(0.1)}, {"a": 0, "b": 0})
    with pytest.raises(TypeError):
        optim.masked(optim.sgd(0.1), {"a": True}).init([torch.ones(1)])
    with pytest.raises(ValueError):
        optim.ema(1.0)
    with pytest.raises(ValueError):
        optim.apply_if_finite(optim.sgd(0.1), max_consecutive_errors=-1)
