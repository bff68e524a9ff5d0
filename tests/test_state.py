"""TrainState: creation, immutability, and round trips through torch.save and pytree."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from raympi.core import optim
from raympi.core.precision import LossScaling
from raympi.core.state import TrainState
from raympi.exceptions import ConfigError

torch.set_num_threads(1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    m[3].bias.requires_grad_(False)  # a frozen parameter
    return m


def _equal_trees(a, b) -> bool:
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    return sa == sb and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb))


def _stepped_state(opt: optim.GradientTransformation) -> TrainState:
    """A state whose optimizer state is past its lazy first step."""
    state = TrainState.create(_model(), opt, seed=7)
    grads = {n: torch.ones_like(p) for n, p in state.params.items()}
    updates, opt_state = opt.update(grads, state.opt_state, state.params)
    return state.replace(params=optim.apply_updates(state.params, updates), opt_state=opt_state, step=state.step + 1)


def test_create_copies_and_splits_the_model():
    model = _model()
    state = TrainState.create(model, optim.sgd(0.1, momentum=0.9), seed=3)
    assert list(state.params) == ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight"]
    assert set(state.buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked", "3.bias"}
    assert state.step.dtype == torch.int64 and state.step.ndim == 0 and int(state.step) == 0
    assert int(state.rng_seed) == 3
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert not torch.equal(state.params["0.weight"], model[0].weight)  # a copy, not a view
    assert not state.params["0.weight"].requires_grad


def test_no_trainable_parameter_is_a_clear_error():
    model = nn.Linear(3, 1).requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameter"):
        TrainState.create(model, optim.sgd(0.1))
    with pytest.raises(ConfigError, match="no trainable parameter"):
        TrainState.create(nn.ReLU(), optim.sgd(0.1))


def test_frozen_and_replace():
    state = TrainState.create(_model(), optim.sgd(0.1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.step = torch.tensor(1)
    later = state.replace(step=torch.tensor(5))
    assert int(later.step) == 5 and int(state.step) == 0
    assert later.params is state.params


OPTIMIZERS = {
    "sgd": optim.sgd(0.1, momentum=0.9),
    "adamw_sched": optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(optim.cosine_decay(1e-3, 10))),
    "from_torch": optim.from_torch(torch.optim.RMSprop, lr=1e-3, momentum=0.9),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_torch_save_load_weights_only(tmp_path, name):
    state = _stepped_state(OPTIMIZERS[name])
    torch.save(state.to_dict(), tmp_path / "state.pt")
    loaded = TrainState.from_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert isinstance(loaded, TrainState)
    assert _equal_trees(loaded, state)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_pytree_round_trip(name):
    state = _stepped_state(OPTIMIZERS[name])
    leaves, spec = pytree.tree_flatten(state)
    assert all(isinstance(x, torch.Tensor) for x in leaves)
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert isinstance(rebuilt, TrainState) and _equal_trees(rebuilt, state)
    doubled = pytree.tree_map(lambda x: x * 2, state)
    assert isinstance(doubled, TrainState) and int(doubled.step) == 2 * int(state.step)


def test_from_dict_rejects_foreign_dicts():
    with pytest.raises(ValueError, match="missing"):
        TrainState.from_dict({"params": {}})


def test_create_with_loss_scaling_and_round_trip(tmp_path):
    state = TrainState.create(_model(), optim.sgd(0.1), loss_scaling=LossScaling(init_scale=2.0**8))
    assert state.loss_scale["scale"].dtype == torch.float32 and float(state.loss_scale["scale"]) == 256.0
    assert state.loss_scale["growth_tracker"].dtype == torch.int64 and int(state.loss_scale["growth_tracker"]) == 0
    assert TrainState.create(_model(), optim.sgd(0.1)).loss_scale == {}
    torch.save(state.to_dict(), tmp_path / "state.pt")
    loaded = TrainState.from_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert _equal_trees(loaded, state)
    leaves, spec = pytree.tree_flatten(state)
    assert all(isinstance(x, torch.Tensor) for x in leaves)
    assert _equal_trees(pytree.tree_unflatten(leaves, spec), state)


def test_old_format_dicts_still_load(tmp_path):
    """A checkpoint written before ``loss_scale`` existed: the five original fields only."""
    state = _stepped_state(optim.adamw(1e-3))
    old = {k: v for k, v in state.to_dict().items() if k != "loss_scale"}
    assert set(old) == {"params", "buffers", "opt_state", "step", "rng_seed"}
    torch.save(old, tmp_path / "old.pt")
    loaded = TrainState.from_dict(torch.load(tmp_path / "old.pt", weights_only=True))
    assert loaded.loss_scale == {} and _equal_trees(loaded, state)
    with pytest.raises(ValueError, match="unknown"):
        TrainState.from_dict({**state.to_dict(), "scaler": {}})
