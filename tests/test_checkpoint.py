"""Checkpoint store: atomic folders, checksums, keep-K (the newest, or the best by a metric), fallback, fsspec URIs.
No Ray needed."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import raympi
from raympi.driver.checkpoint import CheckpointStore
from raympi.driver.checkpoint_folders import kept, ranked, score
from raympi.driver.config import parse_config
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


# Keeping the best by a metric (checkpoint_metric): the rule alone, then on real folders.


def test_kept_without_a_metric_is_the_newest_keep():
    names = [f"step-{s:08d}" for s in (2, 4, 6, 8)]
    assert kept(names, {}, 2) == {"step-00000006", "step-00000008"}
    assert kept(names, {n: None for n in names}, 3) == set(names[1:])
    assert kept(names[:1], {}, 3) == set(names[:1]) and kept([], {}, 3) == set()


@pytest.mark.parametrize("mode", ["min", "max"])
def test_kept_by_a_metric_is_the_best_keep_and_the_newest(mode):
    values = {"s1": 0.5, "s2": 0.1, "s3": 0.9, "s4": 0.3, "s5": 0.7}
    names = list(values)
    if mode == "min":
        assert ranked(names, values, mode) == ["s2", "s4", "s1", "s5", "s3"]
        assert kept(names, values, 2, mode) == {"s2", "s4", "s5"}  # s5, the newest, beside the two best
    else:
        assert ranked(names, values, mode) == ["s3", "s5", "s1", "s4", "s2"]
        assert kept(names, values, 2, mode) == {"s3", "s5"}  # the newest is among the best: keep alone
    assert len(kept(names, values, 1, mode)) == 2  # keep + 1 at most


def test_kept_ties_go_to_the_newer_and_unscored_rank_last():
    names = ["s1", "s2", "s3", "s4", "s5"]
    scores = {"s1": 0.2, "s2": None, "s3": 0.2, "s4": 0.9, "s5": None}
    assert ranked(names, scores) == ["s3", "s1", "s4", "s5", "s2"]
    assert kept(names, scores, 1) == {"s3", "s5"}  # the newer of two equal bests, and the newest (unscored)
    assert kept(names, scores, 3) == {"s3", "s1", "s4", "s5"}
    # fewer scored than keep: the newest unscored fill up, the older unscored go
    assert kept(names, {"s1": 0.2}, 3) == {"s1", "s5", "s4"}
    assert kept(names, {}, 3) == kept(names, {n: None for n in names}, 3)


def test_score_takes_finite_numbers_only():
    record = {"loss": 0.5, "n": 3, "nan": float("nan"), "inf": float("inf"), "s": "0.1", "b": True, "none": None}
    scored = {k: score(record, k) for k in (*record, "missing")}
    assert {k: v for k, v in scored.items() if v is not None} == {"loss": 0.5, "n": 3.0}
    assert score(None, "loss") is None and score([0.5], "loss") is None


def _save_with(store: CheckpointStore, step: int, **metrics: float) -> str:
    return store.save(_state(step), {"step": step, "metrics": {"step": step, "loss": 1.0 / step, **metrics}})


def _kept_steps(store: CheckpointStore) -> list[int]:
    return [int(name.removeprefix("step-")) for name in store._names()]


@pytest.mark.parametrize("root", ["local", "memory://raympi-test/best"])
def test_store_keeps_the_best_by_eval_loss_and_the_newest(tmp_path, root):
    root = str(tmp_path / "ck") if root == "local" else root
    store = CheckpointStore(root, keep=2, metric="eval_loss")
    # eval_loss at the even steps only (eval_every=2): the odd ones have no value
    seen = []
    for step, value in [(1, None), (2, 0.8), (3, None), (4, 0.3), (5, None), (6, 0.6), (7, None), (8, 0.9)]:
        _save_with(store, step, **({"eval_loss": value} if value is not None else {}))
        seen.append(_kept_steps(store))
    assert seen == [
        [1],
        [1, 2],  # one scored so far: the newest unscored fills up
        [2, 3],  # the one with a value, and the newer of those without (the newest anyway): 1 goes
        [2, 4],
        [2, 4, 5],
        [4, 6],
        [4, 6, 7],
        [4, 6, 8],  # 8 is the worst, kept as the newest
    ]
    assert store.best().endswith("step-00000004")
    path, manifest, _ = store.latest()
    assert path.endswith("step-00000008") and manifest["step"] == 8  # a resume continues from the newest
    store.close()


def test_store_keeps_the_highest_with_mode_max_and_reads_earlier_runs_folders(tmp_path):
    first = CheckpointStore(str(tmp_path), keep=2, metric="eval_accuracy", mode="max")
    for step, accuracy in [(10, 0.7), (20, 0.9), (30, 0.8)]:
        _save_with(first, step, eval_accuracy=accuracy)
    assert _kept_steps(first) == [20, 30]
    first.close()
    # a resumed run: a new store reads the scores of the folders it did not write from their manifests
    again = CheckpointStore(str(tmp_path), keep=2, metric="eval_accuracy", mode="max")
    assert again.best().endswith("step-00000020")
    _save_with(again, 40, eval_accuracy=0.95)
    assert _kept_steps(again) == [20, 40]
    _save_with(again, 50, eval_accuracy=float("nan"))  # NaN counts as no value: kept only as the newest
    assert _kept_steps(again) == [20, 40, 50]
    _save_with(again, 60, eval_accuracy=0.1)
    assert _kept_steps(again) == [20, 40, 60] and again.best().endswith("step-00000040")
    again.close()


def test_store_rewriting_a_step_takes_its_new_value(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=1, metric="eval_loss")
    _save_with(store, 1, eval_loss=0.1)
    _save_with(store, 2, eval_loss=0.5)
    assert _kept_steps(store) == [1, 2]
    _save_with(store, 2, eval_loss=0.05)  # step 2 run again after a cold restart, now the best
    assert _kept_steps(store) == [2] and store.best().endswith("step-00000002")
    store.close()


def test_a_folder_with_an_unreadable_manifest_has_no_value(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=1, metric="eval_loss")
    _save_with(store, 1, eval_loss=0.1)
    os.makedirs(tmp_path / "step-00000002")
    (tmp_path / "step-00000002" / "manifest.json").write_text("{not json")
    fresh = CheckpointStore(str(tmp_path), keep=1, metric="eval_loss")
    _save_with(fresh, 3, eval_loss=0.2)
    assert _kept_steps(fresh) == [1, 3]  # the damaged 2 ranks below both, and is not the newest
    fresh.close()
    store.close()


def test_no_checkpoint_with_the_metric_keeps_by_age_and_warns_once(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=2, metric="eval_los")
    for step in (1, 2, 3):
        _save_with(store, step, eval_loss=0.5)
    assert _kept_steps(store) == [2, 3]
    with pytest.warns(UserWarning, match=r"checkpoint_metric='eval_los': no checkpoint has a value .*eval_loss, loss"):
        assert store.best() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.best() is None  # once
        plain = CheckpointStore(str(tmp_path / "plain"), keep=2)
        _save_with(plain, 1, eval_loss=0.5)
        assert plain.best() is None  # no metric, nothing to warn of
    store.close()
    plain.close()


def test_checkpoint_mode_needs_a_metric():
    with pytest.raises(ConfigError, match=r"checkpoint_mode='max' orders .* checkpoint_metric, which is not set"):
        parse_config(checkpoint_mode="max")
    with pytest.raises(ConfigError, match="checkpoint_metric"):
        parse_config(checkpoint_metric="")
    cfg = parse_config(checkpoint_metric="eval_accuracy", checkpoint_mode="max", keep_checkpoints=1)
    assert (cfg.checkpoint_metric, cfg.checkpoint_mode) == ("eval_accuracy", "max")
    assert parse_config(checkpoint_metric="eval_loss").checkpoint_mode is None  # "min" where the store is made
