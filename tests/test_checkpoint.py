"""Checkpoint store: atomic folders, checksums, keep-K, fallback, fsspec URIs. No Ray needed."""

from __future__ import annotations

import json
import os

import pytest
import torch

import raympi
from raympi.driver.checkpoint import CheckpointStore
from raympi.exceptions import ConfigError


def _state(step: int) -> dict:
    model = torch.nn.Linear(3, 2)
    state = raympi.TrainState.create(model, raympi.optim.adam(1e-3), seed=step)
    return state.replace(step=torch.tensor(step)).to_dict()


@pytest.mark.parametrize("root", ["local", "memory://raympi-test/run"])
def test_save_keep_and_latest(tmp_path, root):
    root = str(tmp_path / "ck") if root == "local" else root
    store = CheckpointStore(root, keep=2)
    for step in (5, 10, 15):
        store.save_async(_state(step), {"step": step, "epoch": 0})
    store.close()
    path, manifest, state = store.latest()
    assert path.endswith("step-00000015") and manifest["step"] == 15 and int(state["step"]) == 15
    assert store._names() == ["step-00000010", "step-00000015"]
    assert len(manifest["sha256"]) == 64
    loaded = raympi.load_checkpoint(path if "://" not in root else root + "/step-00000015")
    assert isinstance(loaded, raympi.TrainState) and int(loaded.step) == 15


def test_no_temporary_folders_left_and_weights_only(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=3)
    path = store.save(_state(1), {"step": 1})
    assert sorted(os.listdir(tmp_path)) == ["step-00000001"]
    assert sorted(os.listdir(path)) == ["manifest.json", "state.pt"]
    torch.load(os.path.join(path, "state.pt"), weights_only=True)  # plain tensors only
    assert json.loads(open(os.path.join(path, "manifest.json")).read())["bytes"] == os.path.getsize(
        os.path.join(path, "state.pt")
    )


@pytest.mark.parametrize("damage", ["truncate", "flip", "no-manifest"])
def test_damaged_newest_is_reported_and_skipped(tmp_path, damage):
    store = CheckpointStore(str(tmp_path), keep=3)
    store.save(_state(1), {"step": 1})
    newest = store.save(_state(2), {"step": 2})
    blob = os.path.join(newest, "state.pt")
    if damage == "truncate":
        open(blob, "r+b").truncate(50)
    elif damage == "flip":
        data = bytearray(open(blob, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(blob, "wb").write(bytes(data))
    else:
        os.remove(os.path.join(newest, "manifest.json"))
    with pytest.warns(UserWarning, match="step-00000002.*using the previous one"):
        path, manifest, _ = store.latest()
    assert manifest["step"] == 1
    assert os.path.isdir(os.path.join(tmp_path, "corrupt-step-00000002"))


def test_unwritable_dir_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="not writable"):
        CheckpointStore(str(blocker / "sub"))


def test_empty_dir_has_no_latest(tmp_path):
    assert CheckpointStore(str(tmp_path)).latest() is None
    with pytest.raises(FileNotFoundError):
        raympi.load_checkpoint(str(tmp_path))


def test_a_write_removes_leftovers_of_dead_writers_only(tmp_path):
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()  # its PID is gone
    for name in (f".step-00000005.tmp-{dead.pid}", f".step-00000004.old-{dead.pid}", ".step-00000006.tmp-1"):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "manifest.json").write_text("{}")
    store = CheckpointStore(str(tmp_path), keep=3)
    assert store.latest() is None  # leftovers are never taken for checkpoints
    store.save(_state(7), {"step": 7})
    assert sorted(os.listdir(tmp_path)) == [
        ".step-00000006.tmp-1",
        "step-00000007",
    ]  # PID 1 is alive: a write in progress
