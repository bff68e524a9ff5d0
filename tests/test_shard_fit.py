"""fit(shard_optimizer=True) end to end: real Ray actors, real MPI (and gloo), against the unsharded fit."""

from __future__ import annotations

import json
import sys

import pytest
import ray
import torch
import torch.nn.functional as F
from torch import nn

import raympi
from raympi import optim
from raympi.exceptions import ConfigError

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module


class TwoInputs(nn.Module):
    """Two inputs and a regression head; 1,139 parameters, which 2 and 3 ranks cut through the middle of tensors."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(12, 40), nn.Linear(5, 40)
        self.norm = nn.LayerNorm(40)
        self.head = nn.Linear(40, 3)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.a(x) + self.b(z))))


def _data(n: int = 192, seed: int = 0) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, z = torch.randn(n, 12, generator=g), torch.randn(n, 5, generator=g)
    return (x, z), (x[:, :3] * 2 - z[:, :3]).sin()


def _opt() -> optim.GradientTransformation:
    decay = lambda p: {n: t.ndim >= 2 for n, t in p.items()}  # noqa: E731  (resolved on the full shapes)
    return optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(0.01, weight_decay=0.1, mask=decay), optim.ema(0.9))


def _fit(tmp_path, name: str, **kw):
    options = dict(
        epochs=2,
        batch_size=24,
        optimizer=_opt(),
        loss_fn=F.mse_loss,
        progress=False,
        checkpoint_dir=str(tmp_path / name),
        eval_dataset=_data(48, seed=1),
        eval_every=8,
        eval_with_ema=True,
    )
    options.update(kw)
    return raympi.fit(TwoInputs(), _data(), **options)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def unsharded(ray_session, tmp_path_factory):
    return _fit(tmp_path_factory.mktemp("ref"), "ref", workers=2)


@pytest.mark.parametrize("workers, transport", [(2, "mpi"), (3, "mpi"), (2, "gloo"), (1, "auto")])
def test_sharded_fit_ends_where_the_unsharded_one_does(unsharded, tmp_path, workers, transport):
    got = _fit(tmp_path, "s", workers=workers, shard_optimizer=True, grad_transport=transport)
    assert len(got.metrics) == len(unsharded.metrics) == 16
    assert _max_diff(got.state.params, unsharded.state.params) <= 1e-5
    # the whole optimizer state comes back (joined from the ranks' slices), the EMA with it
    assert not isinstance(got.state.opt_state, optim.ShardedState)
    assert _max_diff(got.ema, unsharded.ema) <= 1e-5
    for mine, theirs in zip(got.metrics, unsharded.metrics):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5, abs=1e-6)
        if "eval_loss" in theirs:  # evaluated with the EMA, gathered from the slices
            assert mine["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-5)


def test_a_sharded_run_resumes_at_another_world_size(unsharded, tmp_path):
    _fit(tmp_path, "parts", workers=3, shard_optimizer=True, max_steps=6, checkpoint_every=3)
    assert sorted(p.name for p in (tmp_path / "parts").glob("step-*"))[-1] == "step-00000006"
    # every rank wrote its own file; the manifest lists them; only rank 0's holds the parameters
    newest = tmp_path / "parts" / "step-00000006"
    manifest = json.loads((newest / "manifest.json").read_text())
    assert [s["file"] for s in manifest["shards"]] == ["shard-00000.pt", "shard-00001.pt", "shard-00002.pt"]
    assert manifest["written_by"] == "3 ranks" and not (newest / "state.pt").exists()
    assert torch.load(newest / "shard-00001.pt", weights_only=True)["params"] == {}
    whole = raympi.load_checkpoint(str(tmp_path / "parts"))  # a whole TrainState, as unsharded
    assert not isinstance(whole.opt_state, optim.ShardedState)
    assert int(whole.step) == 6
    resumed = _fit(tmp_path, "parts", workers=2, shard_optimizer=True, resume=True)
    assert [m["world_size"] for m in resumed.metrics][5:7] == [3, 2]
    assert _max_diff(resumed.state.params, unsharded.state.params) <= 1e-5
    # and an unsharded run resumes from a sharded run's checkpoint
    plain = _fit(tmp_path, "parts", workers=2, resume=True, max_steps=16)
    assert _max_diff(plain.state.params, unsharded.state.params) <= 1e-5


def test_a_damaged_slice_file_falls_back_to_the_previous_checkpoint(tmp_path, ray_session):
    _fit(tmp_path, "parts", workers=2, shard_optimizer=True, max_steps=4, checkpoint_every=2)
    part = tmp_path / "parts" / "step-00000004" / "shard-00001.pt"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="checksum mismatch in shard-00001.pt"):
        state = raympi.load_checkpoint(str(tmp_path / "parts"))
    assert int(state.step) == 2


def test_without_direct_writes_the_driver_writes_the_joined_state(tmp_path, ray_session):
    _fit(
        tmp_path, "one", workers=2, shard_optimizer=True, max_steps=2, checkpoint_every=2, direct_checkpoint_bytes=None
    )
    assert (tmp_path / "one" / "step-00000002" / "state.pt").exists()
    assert not isinstance(raympi.load_checkpoint(str(tmp_path / "one")).opt_state, optim.ShardedState)


def test_options_that_do_not_combine_are_refused(ray_session):
    with pytest.raises(ConfigError, match="shard_optimizer=True does not combine with compression"):
        raympi.fit(TwoInputs(), _data(), shard_optimizer=True, compression="bf16", loss_fn=F.mse_loss)
    with pytest.raises(ConfigError, match="shard_optimizer=True does not combine with overlap=True"):
        raympi.fit(TwoInputs(), _data(), shard_optimizer=True, overlap=True, loss_fn=F.mse_loss)
    with pytest.raises(ConfigError, match="from_torch"):
        raympi.fit(
            TwoInputs(),
            _data(),
            workers=2,
            shard_optimizer=True,
            loss_fn=F.mse_loss,
            optimizer=optim.from_torch(torch.optim.RMSprop, lr=0.01),
            progress=False,
        )
