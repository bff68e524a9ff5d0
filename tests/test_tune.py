"""Ray Tune sweeps of ``fit`` on 2 CPUs: trials reserve their workers (raympi.tune.trainable) and queue,
every step reaches Tune, checkpoints go to Tune and come back (PBT), a plain trainable fails at once."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import ray.cloudpickle
import torch
from torch import nn

import raympi
from raympi.exceptions import ConfigError

tune = pytest.importorskip("ray.tune")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # trial actors cannot import this test module

N, BATCH = 256, 32  # 8 steps an epoch


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 8, generator=g)
    return x, (x[:, 0] > 0).long()


def _meet(folder: str, trials: int, timeout_s: float = 120.0) -> None:
    """Sign in at ``folder`` and wait until ``trials`` workers have (or ``timeout_s`` passed)."""
    Path(folder, str(os.getpid())).touch()
    deadline = time.monotonic() + timeout_s
    while len(os.listdir(folder)) < trials and time.monotonic() < deadline:
        time.sleep(0.05)


class Paced(nn.Sequential):
    """Steps of at least ``pause`` seconds, so that trials run side by side long enough for PBT to compare them;
    with ``meet`` (a folder), the first step waits for the other trial's worker to take its first step too: on
    a loaded machine a trial whose worker started late found the other one finished, with nobody to learn from."""

    pause = 0.0
    meet: str | None = None
    trial_driver = -1  # the pid of the process that calls fit (its one-batch dry run steps there first)

    def forward(self, x):
        if self.meet is not None and os.getpid() != self.trial_driver and not getattr(self, "met", False):
            _meet(self.meet, 2)
            self.met = True
        time.sleep(self.pause)
        return super().forward(x)


def train_fn(config):
    torch.manual_seed(0)
    model = Paced(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    model.pause = config.get("pause", 0.0)
    model.meet, model.trial_driver = config.get("meet"), os.getpid()
    raympi.fit(
        model,
        _data(),
        workers=config.get("workers", 1),
        epochs=config.get("epochs", 2),
        batch_size=BATCH,
        optimizer=raympi.optim.sgd(config["lr"]),
        eval_dataset=_data(),
        eval_every=8,
        checkpoint_every=config.get("checkpoint_every", 0),
        progress=False,
        torch_threads=1,
    )


@pytest.fixture(scope="module")
def two_cpus():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


def _all_released(ray) -> bool:
    """Every CPU free again within a few seconds: no trial or worker actor left holding one."""
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    return ray.available_resources().get("CPU", 0) == 2


def _tuner(trainable, tmp_path, param_space, **tune_config):
    from ray.tune import RunConfig

    return tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(**tune_config),
        run_config=RunConfig(storage_path=str(tmp_path), name="sweep", verbose=0),
    )


def test_an_asha_sweep_of_three_trials_runs_every_trial_on_two_cpus(two_cpus, tmp_path):
    from ray.tune.schedulers import ASHAScheduler

    asha = ASHAScheduler(time_attr="step", max_t=16, grace_period=8, reduction_factor=2)
    trainable = raympi.tune.trainable(train_fn, workers=2)
    results = _tuner(
        trainable,
        tmp_path,
        {"lr": tune.grid_search([0.3, 0.1, 0.0]), "workers": 2},
        metric="eval_loss",
        mode="min",
        scheduler=asha,
    ).fit()
    assert not results.errors, results.errors
    frames = [r.metrics_dataframe for r in results]
    steps = [list(f["step"]) for f in frames]
    assert all(s == list(range(1, len(s) + 1)) for s in steps), steps  # every step, in order
    assert max(len(s) for s in steps) == 16 and min(len(s) for s in steps) >= 8
    best = results.get_best_result()
    assert best.config["lr"] != 0.0 and best.metrics["eval_loss"] < frames[-1]["eval_loss"].dropna().iloc[0]
    assert best.checkpoint is not None and raympi.load_checkpoint(best.checkpoint.path).step.item() == 16
    assert _all_released(two_cpus)


def test_pbt_clones_a_trial_from_its_checkpoint(two_cpus, tmp_path):
    from ray.tune.schedulers import PopulationBasedTraining

    pbt = PopulationBasedTraining(
        time_attr="step", perturbation_interval=8, hyperparam_mutations={"lr": [0.3, 0.01]}, quantile_fraction=0.5
    )
    trainable = raympi.tune.trainable(train_fn, workers=1)
    meet = tmp_path / "meet"
    meet.mkdir()
    results = _tuner(
        trainable,
        tmp_path,
        {"lr": tune.grid_search([0.3, 0.0]), "epochs": 4, "checkpoint_every": 8, "pause": 0.1, "meet": str(meet)},
        metric="loss",
        mode="min",
        scheduler=pbt,
    ).fit()
    assert not results.errors, results.errors
    for result in results:
        assert result.metrics["step"] == 32 and result.checkpoint is not None
    # the weak trial (lr 0 learns nothing) took the strong one's checkpoint and a mutated lr at a
    # perturbation: no trial ends with lr 0, and both end on a trained model
    assert all(r.config["lr"] != 0.0 for r in results), [r.config for r in results]
    frames = [r.metrics_dataframe for r in results]
    # A trial's frame may hold only its rows since its last restore (one began at step 17).  Restored from the
    # checkpoint, not afresh: a first iteration after a restore is past step 1, and step 1 is there at most once.
    first_after_restore = [f[f["iterations_since_restore"] == 1] for f in frames]
    assert any((rows["step"] > 1).any() for rows in first_after_restore), "no trial was restored from a checkpoint"
    assert all((f["step"] == 1).sum() <= 1 for f in frames), [
        list(zip(f["step"], f["iterations_since_restore"])) for f in frames
    ]
    assert all(r.metrics["loss"] < 0.6 for r in results), [r.metrics["loss"] for r in results]
    assert len(os.listdir(meet)) >= 2  # both trials' workers stepped side by side
    assert _all_released(two_cpus)


def test_a_plain_trainable_calling_fit_fails_at_once_naming_raympi_tune(two_cpus, tmp_path):
    started = time.monotonic()
    results = _tuner(train_fn, tmp_path, {"lr": 0.1, "workers": 2}).fit()
    assert time.monotonic() - started < 60
    (error,) = results.errors
    assert "raympi.tune.trainable(train_fn, workers=2)" in str(error)


def test_fit_with_more_workers_than_the_trial_reserved_is_refused(two_cpus, tmp_path):
    results = _tuner(raympi.tune.trainable(train_fn, workers=1), tmp_path, {"lr": 0.1, "workers": 2}).fit()
    (error,) = results.errors
    assert "pass the same workers to both" in str(error)


def test_trainable_refuses_no_workers():
    with pytest.raises(ConfigError, match="workers must be at least 1"):
        raympi.tune.trainable(train_fn, workers=0)


def test_reports_go_in_step_order_each_checkpoint_with_its_step(monkeypatch):
    """A checkpoint lands after later steps were done: their records wait, so Tune sees steps in order."""
    sent = []
    report = raympi.tune.TuneReport(checkpoint_every=4, eval_names=("eval_loss",))
    monkeypatch.setattr(report, "_report", lambda record, path: (sent.append((record["step"], path)), None)[1])
    for step in range(1, 7):
        report.on_step({"step": step, "loss": 1.0 / step})
    assert sent == [(1, None), (2, None), (3, None)]  # 4 waits for its checkpoint, and 5, 6 behind it
    report.on_checkpoint("/ck/step-00000004", 4)
    assert sent[3:] == [(4, "/ck/step-00000004"), (5, None)]  # the newest (6) waits: a run's last step is saved
    report.on_checkpoint("/ck/step-00000006", 6)
    report.on_end([])
    assert sent[5:] == [(6, "/ck/step-00000006")]
