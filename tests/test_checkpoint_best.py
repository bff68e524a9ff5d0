"""keep_checkpoints by a metric end to end: a real fit on 2 ranks keeps the best checkpoints by eval_loss and the
newest, Result.best_checkpoint names the best, and resume=True continues from the newest, not the best."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

import raympi
from raympi.driver.checkpoint_folders import kept, score


def _data() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """A separable task, and an eval set with the opposite labels: the better the model learns, the higher its
    eval_loss, so the best checkpoints by eval_loss are the oldest and the newest is the worst."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(640, 8, generator=generator)
    y = (x[:, 0] > 0).long()
    return (x[:512], y[:512]), (x[512:], 1 - y[512:])


class _Steps:
    """Records the steps a run computes (driver side)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step(self, record: dict) -> None:
        self.steps.append(record["step"])


def _fit(folder: pathlib.Path, max_steps: int, **options):
    train, held_out = _data()
    torch.manual_seed(0)
    return raympi.fit(
        torch.nn.Linear(8, 2),
        train,
        workers=2,
        batch_size=32,
        max_steps=max_steps,
        optimizer=raympi.optim.sgd(0.5),
        eval_dataset=held_out,
        eval_every=4,  # the checkpoints at steps 2, 6, 10, 14 have no eval_loss
        checkpoint_every=2,
        keep_checkpoints=2,
        checkpoint_metric="eval_loss",
        checkpoint_dir=str(folder),
        progress=False,
        **options,
    )


def _steps(folder: pathlib.Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in folder.glob("step-*"))


def _expected(metrics: list[dict], every: int, keep: int) -> list[int]:
    """The steps kept by the rule, from the run's own records: a checkpoint's manifest holds its step's record."""
    names = [f"step-{r['step']:08d}" for r in metrics if r["step"] % every == 0 or r is metrics[-1]]
    scores = {f"step-{r['step']:08d}": score(r, "eval_loss") for r in metrics}
    return sorted(int(n.removeprefix("step-")) for n in kept(names, scores, keep))


@pytest.mark.timeout(240)
def test_best_by_eval_loss_and_the_newest_are_kept_and_resume_takes_the_newest(ray_session, tmp_path):
    folder = tmp_path / "best"
    first = _fit(folder, max_steps=12)
    losses = {r["step"]: r["eval_loss"] for r in first.metrics if "eval_loss" in r}
    assert sorted(losses) == [4, 8, 12] and losses[4] < losses[8] < losses[12], losses  # worse as it learns
    assert _steps(folder) == _expected(first.metrics, 2, 2) == [4, 8, 12]  # the best two, and the newest (worst)
    for step in _steps(folder):  # what the rule read: each manifest's record
        manifest = json.loads((folder / f"step-{step:08d}" / "manifest.json").read_text())
        assert manifest["metrics"]["eval_loss"] == losses[step]
    assert first.best_checkpoint is not None and first.best_checkpoint.endswith("step-00000004")
    assert first.checkpoint is not None and first.checkpoint.endswith("step-00000012")
    best = raympi.load_checkpoint(first.best_checkpoint)
    assert int(best.step) == 4

    seen = _Steps()
    resumed = _fit(folder, max_steps=16, resume=True, callbacks=[seen])
    assert seen.steps == [13, 14, 15, 16]  # from the newest (12), not the best (4)
    assert [r["step"] for r in resumed.metrics] == list(range(1, 17))
    assert [r["time"] for r in resumed.metrics[:12]] == [r["time"] for r in first.metrics]  # not run again
    assert _steps(folder) == _expected(resumed.metrics, 2, 2) == [4, 8, 16]
    assert resumed.best_checkpoint is not None and resumed.best_checkpoint.endswith("step-00000004")
