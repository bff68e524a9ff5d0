"""Large checkpoints written by rank 0 straight to storage (direct_checkpoint_bytes), real Ray and MPI.

The threshold is set to one byte so that the small models here take the path of a large state.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import threading
import time

import pytest
import torch
from torch import nn

import procs
import raympi
from raympi.driver import checkpoint as checkpoint_module
from raympi.driver import fit as fit_module
from raympi.driver.checkpoint import CheckpointStore

N = 512
OPTIONS = dict(
    epochs=2,
    batch_size=32,
    checkpoint_every=4,
    progress=False,
    seed=1,
    optimizer=raympi.optim.sgd(0.05, momentum=0.9),
    step_timeout_s=8.0,
    restart_timeout_s=30.0,
)


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 20, generator=g)
    return x, (x[:, 0] + x[:, 1] > 0).long()


def _net(slow: bool = False) -> nn.Module:
    class Slow(nn.Sequential):  # pickled by value: the workers cannot import tests/
        def forward(self, x):
            if slow:
                time.sleep(0.03)
            return super().forward(x)

    torch.manual_seed(0)
    return Slow(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))


@pytest.fixture
def stores(monkeypatch):
    """Every CheckpointStore that fit makes (to read how many state bytes the driver received)."""
    made: list[CheckpointStore] = []

    class Recording(CheckpointStore):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(fit_module, "CheckpointStore", Recording)
    return made


def _fit(folder, workers=2, net=None, **kw):
    return raympi.fit(net or _net(), _data(), workers=workers, checkpoint_dir=str(folder), **{**OPTIONS, **kw})


def _same(a, b) -> bool:
    return all(torch.equal(a.params[k], b.params[k]) for k in a.params) and int(a.step) == int(b.step)


def _max_diff(a, b) -> float:
    return max((a.params[k] - b.params[k]).abs().max().item() for k in a.params)


@pytest.fixture(scope="module")
def driver_written(ray_session, tmp_path_factory):
    folder = tmp_path_factory.mktemp("driver")
    return folder, _fit(folder, direct_checkpoint_bytes=None)


def test_rank0_writes_the_same_checkpoints_and_the_driver_never_receives_the_state(driver_written, tmp_path, stores):
    folder, expected = driver_written
    result = _fit(tmp_path, direct_checkpoint_bytes=1)
    assert stores[0].received_bytes == 0, "the driver fetched a state that rank 0 should have written"
    names = sorted(p.name for p in tmp_path.glob("step-*"))
    assert names == sorted(p.name for p in folder.glob("step-*")) == ["step-00000024", "step-00000028", "step-00000032"]
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []  # no temporary folder left
    for name in names:
        manifest = json.loads((tmp_path / name / "manifest.json").read_text())
        assert manifest["written_by"] == "rank 0" and manifest["bytes"] == (tmp_path / name / "state.pt").stat().st_size
        assert manifest["blocked_s"] >= manifest["copy_s"] >= 0 and manifest["write_s"] > 0
        assert _same(raympi.load_checkpoint(str(tmp_path / name)), raympi.load_checkpoint(str(folder / name)))
    assert _same(result.state, expected.state) and result.checkpoint == str(tmp_path / "step-00000032")
    assert [r["loss"] for r in result.metrics] == [r["loss"] for r in expected.metrics]


def test_resume_from_rank0_checkpoints_ends_on_the_uninterrupted_run(driver_written, tmp_path, stores):
    _, expected = driver_written
    _fit(tmp_path, direct_checkpoint_bytes=1, max_steps=10)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000004", "step-00000008", "step-00000010"]
    resumed = _fit(tmp_path, direct_checkpoint_bytes=1, resume=True)
    assert stores[1].received_bytes == 0  # the workers read the checkpoint from storage, not from the driver
    assert [r["step"] for r in resumed.metrics] == list(range(1, 33))
    assert _max_diff(resumed.state, expected.state) < 1e-5


def test_storage_that_rank0_cannot_see_is_written_by_the_driver_with_a_warning(ray_session, stores):
    root = "memory://raympi-direct-test/run"  # the driver process's memory: the workers cannot see it
    with pytest.warns(UserWarning, match="rank 0 on .* cannot see .*is not storage that rank 0 shares with the driver"):
        result = raympi.fit(
            _net(),
            _data(),
            workers=2,
            checkpoint_dir=root,
            direct_checkpoint_bytes=1,
            **{**OPTIONS, "epochs": 1, "checkpoint_every": 0},
        )
    assert stores[0].received_bytes > 0
    path, manifest, state = CheckpointStore(root).latest()
    assert manifest["step"] == 16 and "written_by" not in manifest
    assert all(torch.equal(state["params"][k], result.state.params[k]) for k in result.state.params)


def test_a_cold_restart_reads_the_rank0_checkpoint_from_storage(driver_written, tmp_path, stores, monkeypatch):
    from raympi.driver import recovery

    def decline(*args, **kwargs):
        raise recovery.WarmSkipped("declined by the test")

    monkeypatch.setattr(recovery, "warm", decline)
    _, expected = driver_written

    def kill_a_rank():  # as soon as rank 0 has written a checkpoint: the run has ~1 s to go
        while not (tmp_path / "step-00000004").exists():
            time.sleep(0.01)
        os.kill(procs.training_ranks(least=1)[-1].pid, signal.SIGKILL)

    threading.Thread(target=kill_a_rank, daemon=True).start()
    result = _fit(tmp_path, net=_net(slow=True), direct_checkpoint_bytes=1, spares=0)
    record = result.restarts[0]
    assert record["path"] == "cold" and record["restored_step"] >= 4, record
    assert stores[0].received_bytes == 0
    assert [r["step"] for r in result.metrics] == list(range(1, 33))
    assert _max_diff(result.state, expected.state) < 1e-5


def test_rank0_lost_midway_costs_that_checkpoint_only(ray_session, tmp_path):
    import ray

    @ray.remote(concurrency_groups={"health": 1})
    class Rank0:
        """Rank 0's two checkpoint methods over a state whose write never ends."""

        def __init__(self):
            from raympi.worker import checkpoint_io

            checkpoint_io.write_state = lambda *args, **kwargs: time.sleep(3600)
            self.writer = checkpoint_io.DirectWriter()

        def checkpoint(self, folder, min_bytes):
            return self.writer.start({"w": torch.ones(1000)}, folder, min_bytes)

        @ray.method(concurrency_group="health")
        def checkpoint_status(self, folder):
            return self.writer.status(folder)

    store = CheckpointStore(str(tmp_path), keep=3, fetch_timeout_s=30, direct_bytes=1)
    store.save({"w": torch.zeros(3)}, {"step": 4})
    actor = Rank0.remote()
    request = store.request(actor, 8)
    assert pathlib.Path(request.tmp).is_dir()
    store.save_async(request, {"step": 8})
    ray.get(request.ref)
    ray.kill(actor)
    with pytest.warns(
        UserWarning,
        match="step-00000008 not written: rank 0 was lost while writing .*the newest checkpoint is still step-00000004",
    ):
        store.wait(strict=True)  # a lost checkpoint, not an error
    assert [step for _, step, _ in store.drain_saved()] == []  # step 4 was saved directly, 8 never
    assert sorted(os.listdir(tmp_path)) == ["step-00000004"]
    assert checkpoint_module.CheckpointStore(str(tmp_path)).latest()[1]["step"] == 4
    store.close()
