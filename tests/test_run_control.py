"""What a run does for its user: callbacks and early stopping, TensorBoard, safe resume, the
trainer features through fit, and errors that point at the setting to change (signals and
oversubscribed local runs: tests/test_elastic.py, which runs drivers in subprocesses)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import raympi
from raympi.exceptions import CapacityError, ConfigError, NonFiniteLossError

N = 256


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 8, generator=g)
    return x, (x[:, 0] > 0).long()


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _fit(tmp_path, name="ck", **kw):
    options = dict(
        workers=2,
        epochs=4,
        batch_size=32,
        progress=False,
        optimizer=raympi.optim.sgd(0.1),
        checkpoint_dir=str(tmp_path / name),
    )
    return raympi.fit(kw.pop("model", None) or _net(), kw.pop("dataset", None) or _data(), **{**options, **kw})


class Recorder(raympi.callbacks.Callback):
    def __init__(self) -> None:
        self.steps, self.evals, self.checkpoints, self.ended = [], [], [], None

    def on_step(self, record):
        self.steps.append(record["step"])

    def on_eval(self, record):
        self.evals.append(record["step"])

    def on_checkpoint(self, path, step):
        self.checkpoints.append((os.path.basename(path), step))

    def on_end(self, records):
        self.ended = len(records)


def test_callbacks_see_every_step_eval_and_checkpoint(ray_session, tmp_path):
    rec = Recorder()
    result = _fit(tmp_path, eval_dataset=_data(), eval_every=8, checkpoint_every=16, callbacks=[rec])
    assert rec.steps == list(range(1, 33)) and rec.evals == [8, 16, 24, 32]
    assert rec.checkpoints == [("step-00000016", 16), ("step-00000032", 32)]
    assert rec.ended == len(result.metrics) == 32


def test_early_stopping_ends_the_run_with_a_checkpoint(ray_session, tmp_path):
    class Flat(nn.Module):  # eval_loss never improves after the first evaluation
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 2)

        def forward(self, x):
            return self.lin(x) * 0.0

    stopper = raympi.callbacks.EarlyStopping("eval_loss", patience=2)
    result = _fit(tmp_path, model=Flat(), epochs=20, eval_dataset=_data(), eval_every=4, callbacks=[stopper])
    assert stopper.stopped_at == 12  # evaluations at 4 (best), 8, 12: two without improvement
    last = result.metrics[-1]["step"]  # the steps already in flight at 12 are finished, no new ones sent
    assert 12 <= last <= 16 < 20 * (N // 32)
    assert result.checkpoint.endswith(f"step-{last:08d}")
    assert raympi.load_checkpoint(result.checkpoint).step.item() == last


def test_tensorboard_event_files_are_readable(ray_session, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _fit(tmp_path, eval_dataset=_data(), eval_every=16, callbacks=[raympi.callbacks.TensorBoard(str(tmp_path / "tb"))])
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"loss", "accuracy", "eval_loss", "eval_accuracy"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("loss")] == list(range(1, 33))
    assert [e.step for e in events.Scalars("eval_loss")] == [16, 32]
    assert {f"rank/{k}_ms/{r}" for k in ("data", "compute", "collective") for r in (0, 1)} <= set(
        events.Tags()["scalars"]
    )


def test_the_report_of_a_real_run_names_its_two_ranks(ray_session, tmp_path):
    _fit(tmp_path, epochs=1)
    timeline = tmp_path / "ck" / "timeline.png"
    assert timeline.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # fit draws it at its end, beside metrics.png
    timeline.unlink()
    done = subprocess.run(
        [sys.executable, "-m", "raympi", "report", str(tmp_path / "ck")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if re.fullmatch(r" *\d+( +[\d.]+){4}", line)]
    assert [row[0] for row in rows] == ["0", "1"], done.stdout
    assert "steps run (to step 8), world 2" in done.stdout and "slowest by compute: rank " in done.stdout
    assert "restarts: 0, from step-00000008/manifest.json" in done.stdout
    assert (tmp_path / "ck" / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def five_steps(ray_session, tmp_path_factory):
    """A folder whose checkpoint is step 5 of a run (the tests that change the run only read it)."""
    folder = tmp_path_factory.mktemp("five")
    _fit(folder, max_steps=5)
    return folder


@pytest.mark.parametrize(
    "change, words",
    [
        ({"batch_size": 64}, ["batch_size was 32, now 64"]),
        ({"seed": 7}, ["seed was 0, now 7"]),
        ({"dataset": (_data()[0][:200], _data()[1][:200])}, ["num_samples was 256, now 200"]),
        (
            {"model": nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))},
            ["'0.weight' was of shape [16, 8], now [32, 8]"],
        ),
        (
            {"optimizer": raympi.optim.adam(1e-3)},
            ['the optimizer state was {"count": []}, now {"count": [], "mu": "per parameter", "nu": "per parameter"}'],
        ),
        ({"optimizer": raympi.optim.sgd(0.1, momentum=0.9)}, ['now {"count": [], "trace": "per parameter"}']),
    ],
)
def test_resume_with_another_configuration_names_each_difference(five_steps, change, words):
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        _fit(five_steps, resume=True, **change)
    assert all(w in str(info.value) for w in words), str(info.value)
    assert "new checkpoint_dir" in str(info.value) and time.monotonic() - start < 10


def test_resume_with_the_same_configuration_or_a_new_learning_rate_continues(five_steps):
    result = _fit(five_steps, resume=True, epochs=2, optimizer=raympi.optim.sgd(0.05))
    assert [r["step"] for r in result.metrics] == list(range(1, 17))


def test_nan_loss_reaches_the_caller_as_itself_and_skip_works(ray_session, tmp_path):
    class Exploding(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 2)

        def forward(self, x):
            return self.lin(x) * float("nan") if bool((x.abs() > 100).any()) else self.lin(x)

    x, y = _data()
    x = x.clone()
    x[40] = 1000.0  # the batch holding sample 40 gives a NaN loss
    with pytest.raises(NonFiniteLossError, match=r"rank \d of 2 on \S+ raised NonFiniteLossError") as raised:
        _fit(tmp_path, model=Exploding(), dataset=(x, y), epochs=1)
    assert "pass on_nonfinite='skip' to raympi.fit" in str(raised.value)  # the option where the user sets it
    result = _fit(tmp_path, "skip", model=Exploding(), dataset=(x, y), epochs=1, on_nonfinite="skip")
    assert len(result.metrics) == N // 32 and sum(bool(r.get("nonfinite")) for r in result.metrics) == 1


def test_use_gpu_on_a_cpu_cluster_points_at_use_gpu(ray_session, tmp_path):
    with pytest.raises(CapacityError, match="use_gpu=False"):
        _fit(tmp_path, use_gpu=True, startup_timeout_s=5)


def test_accumulation_metrics_lr_and_ema_through_fit(ray_session, tmp_path):
    """accumulate=4 gives the update of accumulate=1; user metrics, the injected lr and the EMA are reported."""

    def mae(outputs, targets):
        return (outputs.argmax(1) != targets).float().mean()

    opt = raympi.optim.chain(
        raympi.optim.inject_hyperparams(raympi.optim.sgd)(lr=raympi.optim.cosine_decay(0.1, 32)), raympi.optim.ema(0.9)
    )
    kw = dict(optimizer=opt, metrics={"error": mae}, eval_dataset=_data(), eval_every=16)
    one = _fit(tmp_path, "one", **kw)
    four = _fit(tmp_path, "four", accumulate=4, eval_with_ema=True, **kw)
    diff = max((one.state.params[k] - four.state.params[k]).abs().max().item() for k in one.state.params)
    assert diff < 1e-5
    last = one.metrics[-1]
    assert abs(last["error"] - (1 - last["accuracy"])) < 1e-6 and "eval_error" in last
    assert [round(r["lr"], 6) for r in one.metrics[:2]] == [0.1, round(raympi.optim.cosine_decay(0.1, 32)(1), 6)]
    assert one.ema is not None and set(one.ema) == set(one.state.params)
    assert four.metrics[-1]["eval_loss"] != one.metrics[-1]["eval_loss"]  # evaluated with the EMA weights


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_through_fit_trains_like_fp32(ray_session, tmp_path, precision):
    base = _fit(tmp_path, "fp32", optimizer=raympi.optim.adam(1e-2), eval_dataset=_data())
    mixed = _fit(tmp_path, precision, optimizer=raympi.optim.adam(1e-2), eval_dataset=_data(), precision=precision)
    assert abs(mixed.metrics[-1]["eval_accuracy"] - base.metrics[-1]["eval_accuracy"]) <= 0.02
    if precision == "fp16":
        assert mixed.metrics[0]["loss_scale"] == 2.0**16 and "skipped" in mixed.metrics[-1]
        assert mixed.state.loss_scale  # the scaler's state is checkpointed with the rest


def test_optimizer_layout_folds_parameters_and_older_checkpoints_still_resume():
    """The layout compared on resume: per-parameter dicts folded to which parameters they hold, built on
    the meta device; a wrapped torch optimizer's lazily filled state is an empty dict at init (nothing
    to compare: from_torch's kind is not checked); a checkpoint from before the layout and the frozen
    parameters were recorded is not refused for lacking them."""
    from raympi.driver.fit import _differences, _optimizer_layout

    model = nn.Linear(3, 2)
    chained = raympi.optim.chain(raympi.optim.clip_by_global_norm(1.0), raympi.optim.adamw(1e-3))
    assert _optimizer_layout(chained, model) == [{}, {"count": [], "mu": "per parameter", "nu": "per parameter"}]
    assert _optimizer_layout(raympi.optim.from_torch(torch.optim.RMSprop, lr=0.1), model) == {"count": [], "state": {}}
    decay_weights_only = raympi.optim.adamw(1e-3, weight_decay=0.1, mask=lambda p: {n: n == "weight" for n in p})
    assert _optimizer_layout(decay_weights_only, model) == _optimizer_layout(raympi.optim.adamw(1e-3), model)
    assert _optimizer_layout(raympi.optim.sgd(0.1, momentum=0.9), model) == {"count": [], "trace": "per parameter"}
    only = lambda name: raympi.optim.masked(  # noqa: E731
        raympi.optim.sgd(0.1, momentum=0.9), lambda p: {n: n == name for n in p}
    )
    assert _optimizer_layout(only("weight"), model) == {
        "inner_state": {"count": [], "trace": {"per parameter": ["weight"]}}
    }
    assert _optimizer_layout(only("bias"), model) != _optimizer_layout(only("weight"), model)
    now = {
        "batch_size": 8,
        "seed": 0,
        "num_samples": 64,
        "params": {"weight": [2, 3], "bias": [2]},
        "frozen": [],
        "optimizer_state": _optimizer_layout(raympi.optim.adam(1e-3), model),
    }
    older = {k: v for k, v in now.items() if k not in ("optimizer_state", "frozen")}
    assert _differences(older, now) == [] and _differences({**now, "optimizer_state": {"count": []}}, now)
    assert _differences({**now, "frozen": ["bias"]}, now) == [
        "the frozen parameters (requires_grad=False) were ['bias'], now []"
    ]


def test_bf16_on_a_cpu_without_native_bf16_is_warned_once_at_start(ray_session, tmp_path, monkeypatch, capsys):
    import raympi.driver.fit as fit_module

    monkeypatch.setattr(fit_module, "cpu_has_native_bf16", lambda: False)  # as on a CPU without AVX512-BF16/AMX
    _fit(tmp_path, precision="bf16", epochs=1)  # progress=False: a warning is shown all the same
    err = capsys.readouterr().err
    assert err.count("warning: precision='bf16' on a CPU without native bfloat16") == 1, err
    monkeypatch.setattr(fit_module, "cpu_has_native_bf16", lambda: True)
    _fit(tmp_path, "native", precision="bf16", epochs=1)
    assert "bfloat16" not in capsys.readouterr().err


def _wandb_records(path):
    """The records of a W&B offline run file (LevelDB's log format: 32 KiB blocks of CRC, length, kind, data)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        room = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if room < 7 or (length == 0 and kind == 0):  # the block's zero-filled tail
            pos += room
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def test_mlflow_and_wandb_runs_read_back(ray_session, tmp_path, monkeypatch):
    """Params, metrics per step and per evaluation, read back with MLflow's client and from W&B's offline file."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)  # MLflow's default store: ./mlruns
    monkeypatch.setenv("WANDB_SILENT", "true")
    mlflow_cb = raympi.callbacks.MLflow(experiment="tests", flush_every=5)
    wandb_cb = raympi.callbacks.WandB("tests", mode="offline", dir=str(tmp_path))
    _fit(tmp_path, eval_dataset=_data(), eval_every=8, epochs=2, callbacks=[mlflow_cb, wandb_cb])

    client = MlflowClient(tracking_uri=f"file://{tmp_path / 'mlruns'}")
    run = client.get_run(mlflow_cb.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["workers"] == "2" and run.data.params["batch_size"] == "32"
    assert run.data.params["num_params"] == str(8 * 16 + 16 + 16 * 2 + 2)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(1, 17))
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval_loss")] == [8, 16]
    assert run.data.tags["raympi.checkpoint"].endswith("step-00000016")

    (path,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = _wandb_records(path)
    config = next(r.run.config for r in records if r.WhichOneof("record_type") == "run")
    assert {u.key: u.value_json for u in config.update}["workers"] == "2"
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {"/".join(i.nested_key) or i.key: float(i.value_json) for i in r.history.item}
            history.setdefault(r.history.step.num, {}).update(items)
    assert sorted(s for s, items in history.items() if "loss" in items) == list(range(1, 17))
    assert sorted(s for s, items in history.items() if "eval_loss" in items) == [8, 16]
    assert history[16]["eval_loss"] == pytest.approx(client.get_metric_history(run.info.run_id, "eval_loss")[-1].value)


def test_a_logger_is_told_when_the_run_fails(ray_session, tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    mlflow_cb = raympi.callbacks.MLflow()
    x, y = _data()
    x = x.clone()
    x[40] = float("nan")
    with pytest.raises(NonFiniteLossError):
        _fit(tmp_path, dataset=(x, y), callbacks=[mlflow_cb])
    status = MlflowClient(tracking_uri=f"file://{tmp_path / 'mlruns'}").get_run(mlflow_cb.run_id).info.status
    assert status == "FAILED"
