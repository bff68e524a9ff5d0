"""Optimizer states: a NamedTuple per transformation, found by type, saved plain, and old checkpoints still resume.

No Ray running (``raympi.driver.fit`` is imported for the manifest's layout only).
"""

from __future__ import annotations

import importlib.util
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from raympi.core import optim, pytree
from raympi.core.state import TrainState
from raympi.core.step import make_train_step

torch.set_num_threads(1)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
_spec = importlib.util.spec_from_file_location("old_optimizer_states", FIXTURES / "old_optimizer_states.py")
old = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(old)
CASES = old.cases()


def _same(a, b) -> bool:
    """Same tree structure (types included) and equal leaves, dtypes too."""
    la, sa = pytree.flatten(a)
    lb, sb = pytree.flatten(b)
    return sa == sb and all(
        torch.equal(x, y) and x.dtype == y.dtype if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb)
    )


def _close(a, b) -> bool:
    """Same tree structure (types included) and dtypes, float leaves equal up to 1e-5 of each tensor's largest
    value, the rest equal: a fixture written on another CPU differs from this one's arithmetic in the last bits
    (its matmul kernels: AVX2 against AVX-512/AMX), so bit-equality would test the machine, not the loading."""
    la, sa = pytree.flatten(a)
    lb, sb = pytree.flatten(b)

    def near(x: torch.Tensor, y: torch.Tensor) -> bool:
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not x.is_floating_point() or x.numel() == 0:
            return torch.equal(x, y)
        return bool((x - y).abs().max() <= 1e-5 * y.abs().max() + 1e-12)

    return sa == sb and all(near(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb))


def _params() -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in old.model().named_parameters()}


# --------------------------------------------------------------------------- the types


def test_each_transformation_has_its_own_state_type():
    p = _params()
    S = optim
    expected = {
        "sgd": S.ScaleByScheduleState,
        "sgd_momentum": S.TraceState,
        "clip_adamw_schedule": (S.EmptyState, S.ScaleByAdamState),
        "adam_pieces_masked": (S.ScaleByAdamState, S.MaskedState, S.ScaleByScheduleState),
        "multi_transform": S.MultiTransformState,
        "inject_hyperparams": S.InjectHyperparamsState,
        "apply_if_finite": S.ApplyIfFiniteState,
        "ema": (S.ScaleByAdamState, S.EmaState),
        "from_torch": S.FromTorchState,
    }
    for name, opt in CASES.items():
        state = opt.init(p)
        want = expected[name]
        if isinstance(want, tuple):
            assert type(state) is tuple and tuple(type(s) for s in state) == want, name
        else:
            assert type(state) is want, name
    assert (
        type(optim.masked(optim.sgd(0.1, momentum=0.9), lambda q: {n: True for n in q}).init(p).inner_state)
        is S.TraceState
    )
    mt = CASES["multi_transform"].init(p).inner_states
    assert type(mt["head"]) is S.ScaleByAdamState and type(mt["body"]) is S.EmptyState
    assert type(CASES["inject_hyperparams"].init(p).inner_state) is S.TraceState
    assert type(CASES["apply_if_finite"].init(p).inner_state) is S.ScaleByAdamState


def test_states_are_read_by_field_and_found_by_type():
    p = _params()
    state = optim.chain(
        optim.clip_by_global_norm(1.0), optim.inject_hyperparams(optim.adam)(lr=0.01), optim.ema(0.5)
    ).init(p)
    assert int(state[1].count) == 0 and set(state[1].inner_state.mu) == set(p)
    assert [path for path, _ in optim.find_states(state, optim.EmaState)] == [("2",)]
    assert [path for path, _ in optim.find_states(state, optim.ScaleByAdamState)] == [("1", "inner_state")]
    assert optim.current_hyperparams(state) == {"lr": 0.01}
    assert set(optim.ema_params(state)) == set(p)
    # A dict that merely has a state's keys is not a state any more.
    assert optim.ema_params({"count": torch.tensor(0), "ema": p}) is None


# --------------------------------------------------------------------------- trees, pickles, broadcasts


@pytest.mark.parametrize("name", list(CASES))
def test_states_flatten_and_their_specs_pickle(name):
    """The state is a pytree; its spec (NamedTuple classes of raympi.core.optim) pickles, as a broadcast sends it."""
    from raympi.comm.tensors import pack_tree, unpack_tree

    state = old.stepped(CASES[name])
    leaves, spec = pytree.flatten(state)
    assert all(isinstance(x, torch.Tensor) for x in leaves)
    assert _same(pytree.unflatten(leaves, pickle.loads(pickle.dumps(spec))), state)
    for tree in (state, state.to_dict()):
        (spec, layout, _), payload = pack_tree(tree)
        spec, layout = pickle.loads(pickle.dumps((spec, layout)))
        assert _same(unpack_tree(spec, layout, payload), tree)


@pytest.mark.parametrize("name", list(CASES))
def test_to_dict_is_plain_and_round_trips(name, tmp_path):
    state = old.stepped(CASES[name])
    plain = state.to_dict()
    kinds = {type(x) for x in pytree.leaves(plain["opt_state"])}
    assert kinds <= {torch.Tensor, str}  # no NamedTuple node left: a dict per state, naming its type
    torch.save(plain, tmp_path / "state.pt")
    loaded = TrainState.from_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert _same(loaded, state)


def test_saved_states_load_without_raympi(tmp_path):
    """state.pt stays readable by torch.load(weights_only=True) in a process that never imports raympi."""
    torch.save({name: old.stepped(opt).to_dict() for name, opt in CASES.items()}, tmp_path / "s.pt")
    code = (
        "import sys, torch; d = torch.load(sys.argv[1], weights_only=True); "
        "assert 'raympi' not in sys.modules; print(d['sgd_momentum']['opt_state']['__type__'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "s.pt")], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "TraceState"


def test_from_plain_refuses_unknown_types_and_keeps_foreign_dicts():
    with pytest.raises(ValueError, match="not an optimizer state"):
        optim.from_plain({"count": torch.tensor(1), "__type__": "ScaleByNewtonState"})
    with pytest.raises(ValueError, match="not an optimizer state"):
        optim.from_plain({"count": torch.tensor(1), "__type__": "TraceState"})  # a field missing
    # A state of one's own (a dict) beside raympi's typed ones stays a dict, even with a state's keys.
    mine = {"count": torch.tensor(7)}
    plain = optim.to_plain((optim.EmptyState(), mine))
    back = optim.from_plain(plain)
    assert type(back[0]) is optim.EmptyState and type(back[1]) is dict and back[1] == mine


# --------------------------------------------------------------------------- checkpoints written before the types


OLD_STATES, OLD_LAYOUTS = old.load(FIXTURES)


@pytest.mark.parametrize("name", list(CASES))
def test_old_checkpoint_resumes_on_the_same_trajectory(name, tmp_path):
    """A state saved by raympi 6b6f511 (dict optimizer states), through torch.save / torch.load(weights_only=True)
    as a checkpoint, loads into the new types, equal to the new code's own state after the same two steps, and
    trains on like it (both to within float rounding: see _close)."""
    torch.save(OLD_STATES[name], tmp_path / "state.pt")
    resumed = TrainState.from_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    fresh = old.stepped(CASES[name])
    assert _close(resumed, fresh), name
    step = make_train_step(old.model(), F.cross_entropy, CASES[name])
    assert _close(step(resumed, old.batch(2))[0], step(fresh, old.batch(2))[0])


def test_old_states_are_the_dicts_of_the_new_fields():
    """The fixture really is the old form: each state a dict of its fields, no type names."""
    saved = OLD_STATES
    assert set(saved["sgd_momentum"]["opt_state"]) == {"count", "trace"}
    assert set(saved["apply_if_finite"]["opt_state"]["inner_state"]) == {"count", "mu", "nu"}
    assert saved["clip_adamw_schedule"]["opt_state"][0] == {}
    assert not any(isinstance(x, str) for s in saved.values() for x in pytree.leaves(s))


@pytest.mark.parametrize("name", list(CASES))
def test_manifest_layout_unchanged(name):
    """resume=True compares the manifest's optimizer layout: an old manifest's equals the new one of the same
    optimizer."""
    from raympi.driver.fit import _optimizer_layout

    assert _optimizer_layout(CASES[name], old.model()) == OLD_LAYOUTS[name]


def test_manifest_layout_tells_optimizers_apart():
    from raympi.driver.fit import _optimizer_layout

    assert _optimizer_layout(optim.sgd(0.1, momentum=0.9), old.model()) == OLD_LAYOUTS["sgd_momentum"]
    assert _optimizer_layout(optim.adam(1e-3), old.model()) != OLD_LAYOUTS["sgd_momentum"]
    assert _optimizer_layout(optim.sgd(0.1), old.model()) != OLD_LAYOUTS["sgd_momentum"]
    assert _optimizer_layout(optim.adam(1e-3), old.model()) == OLD_LAYOUTS["apply_if_finite"]["inner_state"]
