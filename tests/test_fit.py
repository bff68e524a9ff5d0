"""raympi.fit end to end: real Ray actors, real MPI, real Fashion-MNIST data."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import time

import pytest
import torch
from torch import nn

import procs
import raympi
from raympi.exceptions import ConfigError, TrainingError
from raympi.exceptions import CapacityError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location("mnist_example", ROOT / "examples" / "mnist.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fashion(tmp_path_factory):
    """A Fashion-MNIST subset from Debian's dataset-fashion-mnist package: 1536 train, 512 held out."""
    example = _example()
    x, y = example.load("fashion-mnist", str(tmp_path_factory.mktemp("data")), train=True)
    return (x[:1536], y[:1536]), (x[-512:], y[-512:])


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))


def _fit(data, tmp_path, name, **kw):
    options = dict(
        epochs=1,
        batch_size=64,
        optimizer=raympi.optim.sgd(0.1, momentum=0.9),
        progress=False,
        checkpoint_dir=str(tmp_path / name),
        seed=3,
    )
    options.update(kw)
    return raympi.fit(_net(), data, **options)


def _max_diff(a, b) -> float:
    return max((a.params[k] - b.params[k]).abs().max().item() for k in a.params)


def _idle(ray, wait_s: float = 15.0) -> bool:
    """Every CPU of the cluster free again: no worker actor or placement group left behind."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0) == ray.cluster_resources().get("CPU", 0):
            return True
        time.sleep(0.25)
    return False


@pytest.fixture(scope="module")
def runs(ray_session, fashion, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    train, held_out = fashion
    return {w: _fit(train, tmp, f"w{w}", workers=w, eval_dataset=held_out) for w in (1, 2, 3)}


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_fit_learns(runs, fashion, workers):
    result = runs[workers]
    losses = [r["loss"] for r in result.metrics]
    assert len(losses) == 1536 // 64
    assert sum(losses[-4:]) / 4 < 0.7 * sum(losses[:4]) / 4
    assert all(r["world_size"] == workers for r in result.metrics)
    x, y = fashion[1]
    with torch.no_grad():
        accuracy = (result.model(x).argmax(1) == y).float().mean().item()
    assert accuracy > 0.5  # chance is 0.1
    assert result.metrics[-1]["eval_accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert result.restarts == []


def test_same_parameters_for_any_world_size(runs):
    assert _max_diff(runs[1].state, runs[3].state) < 1e-4
    assert _max_diff(runs[1].state, runs[2].state) < 1e-4


def test_bf16_compression_trains_close_to_float32(runs, fashion, tmp_path):
    """compression='bf16': the gradients really travel rounded, and training follows the float32 run closely."""
    result = _fit(fashion[0], tmp_path, "bf16", workers=2, compression="bf16")
    a, b = result.state.params, runs[2].state.params
    relative = (sum(((a[k] - b[k]) ** 2).sum() for k in a) / sum((b[k] ** 2).sum() for k in b)).sqrt().item()
    assert 0 < relative < 0.15, relative  # measured 0.064 after these 24 momentum-SGD steps (fp16: 0.012)
    losses = [r["loss"] for r in result.metrics]
    assert abs(losses[-1] - runs[2].metrics[-1]["loss"]) < 0.05
    assert result.restarts == []


def test_reports_next_to_checkpoints(runs):
    folder = pathlib.Path(runs[2].checkpoint).parent
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(runs[2].metrics)
    assert (folder / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    state = raympi.load_checkpoint(runs[2].checkpoint)
    assert _max_diff(state, runs[2].state) == 0


def test_resume_continues_the_same_trajectory(ray_session, fashion, tmp_path):
    train = fashion[0]
    whole = _fit(train, tmp_path, "whole", workers=2, epochs=2)
    _fit(train, tmp_path, "parts", workers=2, epochs=2, max_steps=29, checkpoint_every=5)  # stops mid-epoch 2
    names = sorted(p.name for p in (tmp_path / "parts").glob("step-*"))
    assert names == ["step-00000020", "step-00000025", "step-00000029"]  # keep_checkpoints=3 holds
    resumed = _fit(train, tmp_path, "parts", workers=3, epochs=2, resume=True, checkpoint_every=5)
    assert resumed.metrics[0]["step"] == 1 and resumed.metrics[-1]["step"] == 48
    assert [r["world_size"] for r in resumed.metrics][28:30] == [2, 3]
    assert _max_diff(whole.state, resumed.state) < 1e-4


def test_truncated_newest_checkpoint_falls_back(ray_session, fashion, tmp_path):
    train = fashion[0]
    whole = _fit(train, tmp_path, "whole", workers=2, keep_checkpoints=2)
    _fit(train, tmp_path, "cut", workers=2, max_steps=12, checkpoint_every=5, keep_checkpoints=2)
    newest = tmp_path / "cut" / "step-00000012" / "state.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    with pytest.warns(UserWarning, match="step-00000012.*using the previous one"):
        resumed = _fit(train, tmp_path, "cut", workers=2, resume=True, keep_checkpoints=2)
    assert resumed.metrics[10]["step"] == 11  # steps 11 and 12 were run again
    assert _max_diff(whole.state, resumed.state) < 1e-5
    assert sorted(p.name for p in (tmp_path / "cut").glob("step-*")) == ["step-00000010", "step-00000024"]


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(epoch=1), ConfigError, "unknown option 'epoch'"),
        (dict(workers=0), ConfigError, "workers"),
        (dict(workers=4, batch_size=3), ConfigError, "batch_size=3 is smaller than workers=4"),
        (
            dict(workers=2, checkpoint_dir="/etc/hostname/sub"),
            ConfigError,
            "checkpoint_dir='/etc/hostname/sub' is not writable",
        ),
        (dict(workers=20), CapacityError, "can host 8 worker"),
        (dict(workers=1, use_gpu=True), CapacityError, "can host 0 worker"),
        (dict(workers=1, startup_timeout_s=-1), ConfigError, "startup_timeout_s"),
    ],
)
def test_bad_options(ray_session, fashion, tmp_path, kwargs, error, words):
    raympi.release_workers()  # the workers an earlier test's fit kept (keep_workers): this run must leave none
    options = dict(checkpoint_dir=str(tmp_path / "ck"), progress=False)
    options.update(kwargs)
    start = time.monotonic()
    with pytest.raises(error, match=words.replace("(", r"\(").replace("[", r"\[")):
        raympi.fit(_net(), fashion[0], **options)
    assert time.monotonic() - start < 10
    assert _idle(ray_session)


def test_bad_datasets(ray_session, tmp_path):
    empty = (torch.empty(0, 784), torch.empty(0, dtype=torch.long))
    with pytest.raises(ConfigError, match="empty"):
        raympi.fit(_net(), empty, workers=2, checkpoint_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="map-style"):
        raympi.fit(_net(), 42, workers=2, checkpoint_dir=str(tmp_path))
    wrong_shape = (torch.randn(128, 3, 7), torch.zeros(128, dtype=torch.long))
    with pytest.raises(TrainingError, match="do not fit the model"):
        raympi.fit(_net(), wrong_shape, workers=2, checkpoint_dir=str(tmp_path))
    assert _idle(ray_session)


def test_user_error_on_a_worker_names_rank_and_host(ray_session, tmp_path):
    class Fussy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x):
            if x.shape[0] == 1:  # only rank 2 of 3 sees single-sample batches
                raise RuntimeError("fussy model saw a batch of one")
            return self.lin(x)

    data = (torch.randn(64, 4), torch.zeros(64, dtype=torch.long))
    with pytest.raises(TrainingError, match=r"rank 2 of 3 on \S+ raised RuntimeError: fussy model") as info:
        raympi.fit(Fussy(), data, workers=3, batch_size=5, checkpoint_dir=str(tmp_path), progress=False)
    assert "Traceback on rank 2" in str(info.value) and "in forward" in str(info.value)
    assert _idle(ray_session)


def test_progress_lines_when_not_a_terminal(ray_session, fashion, tmp_path, capsys):
    _fit(fashion[0], tmp_path, "p", workers=1, progress=None, max_steps=8)
    err = capsys.readouterr().err
    assert "raympi: step 8/8 epoch 1 loss" in err and "samples/s" in err


def test_kept_workers_are_taken_by_the_next_fit_of_the_same_shape(ray_session, tmp_path):
    """keep_workers: the next fit of the same shape runs in the processes the last one kept (none started) and
    ends where a fresh run does; a parked worker that died is replaced; another shape, a fit that does not keep
    workers, or release_workers() frees them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 784, generator=g)
    data = (x, (x[:, 0] > 0).long())

    def run(name, workers=2, **kw):
        options = dict(batch_size=32, epochs=1, spares=0, progress=False, checkpoint_dir=str(tmp_path / name))
        return raympi.fit(_net(), data, workers=workers, **{**options, **kw})

    raympi.release_workers()
    fresh = run("fresh", keep_workers=False)
    assert _idle(ray_session) and procs.workers() == []
    run("first", keep_workers=True)
    kept = sorted(p.pid for p in procs.workers())
    assert len(kept) == 2
    again = run("again", keep_workers=True)
    assert sorted(p.pid for p in procs.workers()) == kept  # the same two processes: none started, none ended
    assert _max_diff(again.state, fresh.state) == 0.0

    os.kill(kept[1], 9)  # a parked worker dies: the next fit starts afresh
    after_loss = run("after_loss", keep_workers=True)
    assert _max_diff(after_loss.state, fresh.state) == 0.0
    assert len(procs.workers()) == 2 and kept[1] not in [p.pid for p in procs.workers()]

    run("other_shape", workers=1, keep_workers=True)  # another shape: the two kept are ended, this one kept
    assert len(procs.workers()) == 1
    run("not_kept", workers=1, keep_workers=False)
    assert _idle(ray_session)
    run("kept_again", workers=1, keep_workers=True)
    raympi.release_workers()
    assert _idle(ray_session)


def _pids(n: int, wait_s: float = 15.0) -> list[int]:
    """This test run's worker processes, once there are ``n`` (killed actors take a moment to exit)."""
    deadline = time.monotonic() + wait_s
    while len(found := sorted(p.pid for p in procs.workers())) != n and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def test_example_runs_end_to_end(ray_session, tmp_path, capsys):
    result = _example().main(
        [
            "--subset",
            "640",
            "--epochs",
            "1",
            "--workers",
            "2",
            "--data-dir",
            str(tmp_path / "data"),
            "--checkpoint-dir",
            str(tmp_path / "ck"),
        ]
    )
    out = capsys.readouterr().out
    assert "fashion-mnist: test accuracy" in out
    assert result.checkpoint and os.path.exists(os.path.join(result.checkpoint, "manifest.json"))


def test_ray_dataset_is_split_per_rank_by_ray_data(ray_session, fashion, tmp_path):
    import ray.data

    x, y = fashion[0]
    ds = ray.data.from_items([{"image": x[i].numpy(), "label": int(y[i])} for i in range(len(x))])
    result = _fit(ds, tmp_path, "rd", workers=2, epochs=2)
    losses = [r["loss"] for r in result.metrics]
    assert len(losses) == 2 * (len(x) // 2 // 32)
    assert sum(losses[-4:]) < 0.7 * sum(losses[:4])
    with pytest.raises(ConfigError, match="not among the dataset's columns"):
        _fit(ds, tmp_path, "rd2", workers=2, columns=("img", "label"))


def test_ray_dataset_streams_and_resumes_exactly_with_preserve_order(ray_session, tmp_path):
    """A Ray Dataset is streamed per rank; with preserve_order its order is fixed, so a resumed run
    (the interrupted epoch re-streamed and skipped to the cursor) ends on the uninterrupted run."""
    import ray.data

    context = ray.data.DataContext.get_current()
    saved, context.execution_options.preserve_order = context.execution_options.preserve_order, True
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(512, 6, generator=g)
        ds = ray.data.from_numpy(x.numpy()).zip(
            ray.data.from_numpy((x[:, 0] > 0).long().numpy()).rename_columns({"data": "label"})
        )

        def net():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))

        opts = dict(
            workers=2,
            epochs=2,
            batch_size=32,
            progress=False,
            optimizer=raympi.optim.sgd(0.1),
            columns=("data", "label"),
        )
        whole = raympi.fit(net(), ds, checkpoint_dir=str(tmp_path / "whole"), **opts)
        raympi.fit(net(), ds, checkpoint_dir=str(tmp_path / "cut"), max_steps=11, **opts)
        resumed = raympi.fit(net(), ds, checkpoint_dir=str(tmp_path / "cut"), resume=True, **opts)
    finally:
        context.execution_options.preserve_order = saved
    assert [r["step"] for r in resumed.metrics] == list(range(1, 33))
    diff = max((whole.state.params[k] - resumed.state.params[k]).abs().max().item() for k in whole.state.params)
    assert diff < 1e-6


def test_regression_reports_no_accuracy(ray_session, tmp_path):
    """MSE on float targets: loss and eval_loss only; accuracy does not apply (and is not reported as 0)."""
    torch.manual_seed(0)
    x = torch.randn(256, 3)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.1
    result = raympi.fit(
        nn.Linear(3, 1),
        (x, y),
        workers=2,
        epochs=3,
        batch_size=32,
        loss_fn=nn.functional.mse_loss,
        optimizer=raympi.optim.sgd(0.1),
        eval_dataset=(x[:64], y[:64]),
        checkpoint_dir=str(tmp_path / "ck"),
        progress=False,
    )
    last = result.metrics[-1]
    assert "eval_loss" in last and last["eval_loss"] < result.metrics[0]["loss"]
    assert not any("accuracy" in key for r in result.metrics for key in r), last


def _worker_env(tmp_path, names, **options) -> list[dict[str, float]]:
    """The environment variables ``names`` as every worker of a short fit sees them (as floats, -1 where unset):
    read by metrics evaluated on each worker, one dict per step."""
    read = {f"env {k}": (lambda k: lambda out, t: torch.tensor(float(os.environ.get(k, "-1"))))(k) for k in names}
    x, y = torch.randn(64, 3), torch.randn(64, 1)
    result = raympi.fit(
        nn.Linear(3, 1),
        (x, y),
        workers=2,
        epochs=1,
        batch_size=32,
        loss_fn=nn.functional.mse_loss,
        metrics=read,
        checkpoint_dir=str(tmp_path / "ck"),
        progress=False,
        **options,
    )
    assert result.metrics, result.metrics
    return [{k: row[f"env {k}"] for k in names} for row in result.metrics]


def test_cpu_workers_run_with_one_malloc_arena(ray_session, tmp_path):
    """The workers' step runs on a Ray thread, to which glibc's default gives an arena it shrinks on free
    (thousands of page faults a step, benchmarks/RESULTS.md): workers take MALLOC_ARENA_MAX=1 (and
    the trim and mmap thresholds) as they start, read here by a metric evaluated on each worker."""
    rows = _worker_env(tmp_path, ["MALLOC_ARENA_MAX"])
    assert rows == [{"MALLOC_ARENA_MAX": 1.0}] * len(rows), rows


def test_workers_take_nccl_error_handling_from_the_group(ray_session, tmp_path):
    """Every worker starts with raympi's NCCL error handling in its environment (raympi.driver.group.NCCL_ENV:
    TORCH_NCCL_ASYNC_ERROR_HANDLING=2, the watchdog aborts the communicators and leaves the process to raympi's
    abort; no heartbeat monitor that kills it), read here by metrics evaluated on each worker of a fit over the
    gloo process group (the NCCL path's code on CPU; torch's ProcessGroupNCCL reads the variables as it is built)."""
    from raympi.driver.group import NCCL_ENV

    assert NCCL_ENV == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0"}
    for row in _worker_env(tmp_path, list(NCCL_ENV), grad_transport="gloo"):
        assert row == {k: float(v) for k, v in NCCL_ENV.items()}, row


def test_the_suites_ray_workers_run_at_its_own_priority(ray_session):
    """Ray lowers its workers to nice 15; tests/conftest.py sets RAY_worker_niceness=0, without which a loaded
    machine starves every worker (and the suite's deadlines run out).  A Ray that stops reading it fails here."""

    @ray_session.remote(num_cpus=1)
    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)

    assert ray_session.get(niceness.remote(), timeout=60) == os.getpriority(os.PRIO_PROCESS, 0)
