"""Real data through fit: a Dataset read on the workers, augmentation redrawn every epoch and
reproducible on any world size, several inputs, bad items named, and no driver-side copy."""

from __future__ import annotations

import os
import sys
import threading
import time

import psutil
import pytest
import torch
from ray import cloudpickle
from torch import nn

import procs
import raympi
from raympi.exceptions import ConfigError, TrainingError

# The workers cannot import tests/: send this module's classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

N, DIM = 96, 6
OPTIONS = dict(batch_size=24, progress=False, seed=3, optimizer=raympi.optim.sgd(0.1, momentum=0.9))


def _base():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, DIM, generator=g)
    return x, (x[:, 0] - x[:, 1] > 0).long()


class Noisy(torch.utils.data.Dataset):
    """Random-noise augmentation drawn from torch's global generator, as torchvision transforms do.

    With ``log`` set, each read appends ``pid index draw`` to that file.
    """

    def __init__(self, log: str | None = None) -> None:
        self.x, self.y = _base()
        self.log = log

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        noise = torch.randn(DIM) * 0.1
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{os.getpid()} {i} {noise[0].item():.6f}\n")
        return self.x[i] + noise, self.y[i]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, 2))


def _fit(dataset, tmp_path, name, **kw):
    return raympi.fit(
        kw.pop("model", None) or _net(), dataset, checkpoint_dir=str(tmp_path / name), **{**OPTIONS, **kw}
    )


def _max_diff(a, b) -> float:
    return max((a.params[k] - b.params[k]).abs().max().item() for k in a.params)


@pytest.mark.parametrize("loader_workers", [0, 1])
def test_augmentation_is_redrawn_every_epoch_on_the_workers(ray_session, tmp_path, loader_workers):
    log = tmp_path / "reads.txt"
    _fit(Noisy(str(log)), tmp_path, "ck", workers=2, epochs=3, loader_workers=loader_workers)
    reads = [line.split() for line in log.read_text().splitlines()]
    assert len(reads) == 3 * N  # every sample read once per epoch, and only by training
    assert {pid for pid, _, _ in reads}.isdisjoint({str(os.getpid())}), "a sample was read in the driver"
    by_index: dict[str, list[str]] = {}
    for _, index, draw in reads:
        by_index.setdefault(index, []).append(draw)
    assert sorted(by_index) == sorted(str(i) for i in range(N)) and all(len(d) == 3 for d in by_index.values())
    assert sum(len(set(d)) == 3 for d in by_index.values()) == N  # a fresh draw each epoch


def test_same_parameters_for_any_world_size_with_random_augmentation(ray_session, tmp_path):
    # 2 last: the un-augmented run below takes the processes it kept (the integration tier keeps workers)
    results = {w: _fit(Noisy(), tmp_path, f"w{w}", workers=w, epochs=2, loader_workers=w % 2) for w in (1, 3, 2)}
    assert _max_diff(results[1].state, results[2].state) < 1e-4
    assert _max_diff(results[1].state, results[3].state) < 1e-4
    # and the augmentation did something: without it the run ends elsewhere
    plain = _fit(_base(), tmp_path, "plain", workers=2, epochs=2)
    assert _max_diff(results[1].state, plain.state) > 1e-3


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(DIM, 2), nn.Linear(3, 2)

    def forward(self, a, b):
        return self.a(a) + self.b(b)


class PairDataset(torch.utils.data.Dataset):
    def __init__(self, as_dict: bool) -> None:
        self.x, self.y = _base()
        self.z = self.x[:, :3] * 2
        self.as_dict = as_dict

    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        return ({"a": self.x[i], "b": self.z[i]} if self.as_dict else (self.x[i], self.z[i])), self.y[i]


def test_two_input_models_train_from_datasets_and_tensors(ray_session, tmp_path):
    x, y = _base()
    z = x[:, :3] * 2
    forms = {
        "tuple tensors": ((x, z), y),
        "dict tensors": ({"a": x, "b": z}, y),
        "tuple dataset": PairDataset(as_dict=False),
        "dict dataset": PairDataset(as_dict=True),
    }
    results = {
        name: _fit(data, tmp_path, name.replace(" ", "-"), workers=2, epochs=2, model=TwoInputs())
        for name, data in forms.items()
    }
    first = results["tuple tensors"]
    assert first.metrics[-1]["loss"] < first.metrics[0]["loss"]
    for name, result in results.items():  # the same samples in the same order: the same training
        assert _max_diff(result.state, first.state) < 1e-5, name


class Poisoned(Noisy):
    def __getitem__(self, i):
        if i == 23:
            raise ValueError("sample 23 is unreadable")
        return super().__getitem__(i)


@pytest.mark.parametrize("loader_workers", [0, 1])
def test_an_item_that_raises_names_the_index_rank_and_host(ray_session, tmp_path, loader_workers):
    start = time.monotonic()
    with pytest.raises(
        TrainingError,
        match=r"rank \d of 2 on \S+ raised TrainingError: reading sample 23 \(epoch \d\) "
        r"raised ValueError: sample 23 is unreadable",
    ) as info:
        _fit(Poisoned(), tmp_path, "ck", workers=2, epochs=2, loader_workers=loader_workers)
    assert "Traceback of the read" in str(info.value) and "__getitem__" in str(info.value)
    assert time.monotonic() - start < 60
    deadline = time.monotonic() + 20  # no worker and no loader process outlives the run
    while procs.workers() and time.monotonic() < deadline:
        time.sleep(0.25)
    assert procs.workers() == []


class Ragged(Noisy):
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return (x[:4] if i == 5 else x), y


def test_items_of_inconsistent_shape_show_both_shapes(ray_session, tmp_path):
    with pytest.raises(
        TrainingError,
        match=r"do not fit together.*\(tensor\(6,\) torch.float32, tensor\(\) torch.int64\)"
        r".*sample 5 is \(tensor\(4,\) torch.float32",
    ):
        _fit(Ragged(), tmp_path, "ck", workers=1, epochs=1, batch_size=N, loader_workers=0, seed=0)


@pytest.mark.parametrize(
    "dataset, words",
    [
        (torch.utils.data.Subset(Noisy(), []), "dataset is empty"),
        (torch.utils.data.Subset(Noisy(), range(10)), "10 samples, fewer than batch_size=24"),
        (((torch.zeros(5, 2), torch.zeros(4, 2)), torch.zeros(5)), "disagree in length"),
        (42, "must be an (inputs, targets) tuple"),
    ],
)
def test_bad_datasets_are_config_errors_before_any_actor(dataset, words, tmp_path, capsys):
    with pytest.raises(ConfigError) as info:
        _fit(dataset, tmp_path, "ck", workers=2, progress=None)
    assert words in str(info.value)
    assert "starting" not in capsys.readouterr().err  # refused before Ray or any worker was started


class Lazy(torch.utils.data.Dataset):
    """A large dataset generated from the index: nothing stored."""

    def __init__(self, n: int, dim: int) -> None:
        self.n, self.dim = n, dim

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(self.dim, generator=g), i % 2


def test_the_driver_never_materializes_a_large_dataset(ray_session, tmp_path):
    me = psutil.Process()
    peak, stop = [me.memory_info().rss], threading.Event()

    def watch():
        while not stop.is_set():
            peak.append(me.memory_info().rss)
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:  # 400,000 samples of 1,024 float32: 1.6 GB if it were ever materialized
        torch.manual_seed(0)
        result = raympi.fit(
            nn.Linear(1024, 2),
            Lazy(400_000, 1024),
            workers=2,
            max_steps=3,
            batch_size=32,
            progress=False,
            checkpoint_dir=str(tmp_path / "ck"),
        )
    finally:
        stop.set()
        thread.join()
    assert [r["step"] for r in result.metrics] == [1, 2, 3]
    assert max(peak) - peak[0] < 200 * 2**20, f"driver RSS grew by {(max(peak) - peak[0]) / 2**20:.0f} MiB"
