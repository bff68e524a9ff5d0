"""A Ray Tune sweep over raympi.fit: ASHA stops the weak trials early, every trial reserves its workers.

    python examples/tune_sweep.py                      # 4 trials of 1 worker on a local Ray instance
    python examples/tune_sweep.py --workers 2 --address auto   # on a cluster

Each trial calls raympi.fit on Fashion-MNIST (a slice of it, so that the sweep takes a few minutes on
a laptop); raympi.tune.trainable gives every trial one placement group (its workers' bundles), so
trials queue for room instead of failing, and fit reports every step and evaluation to Tune.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

import raympi

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mnist  # noqa: E402  (the example's data loader, beside this file)


def train_fn(config: dict) -> None:
    x, y = mnist.load("fashion-mnist", config["data_dir"], train=True)
    tx, ty = mnist.load("fashion-mnist", config["data_dir"], train=False)
    n = config["samples"]
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(28 * 28, config["hidden"]), nn.ReLU(), nn.Linear(config["hidden"], 10)
    )
    raympi.fit(
        model,
        (x[:n], y[:n]),
        workers=config["workers"],
        epochs=config["epochs"],
        batch_size=128,
        optimizer=raympi.optim.adam(config["lr"]),
        eval_dataset=(tx[:2000], ty[:2000]),
        eval_every=25,
        checkpoint_every=50,
        progress=False,
    )


def main() -> None:
    from ray import tune
    from ray.tune import RunConfig
    from ray.tune.schedulers import ASHAScheduler

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=12800, help="training samples per trial")
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--address", default=None, help="Ray cluster (default: a new local instance)")
    parser.add_argument("--storage", default=os.path.abspath("runs/tune"))
    args = parser.parse_args()

    import ray
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(mnist)  # the trials cannot import it: Ray ships it with train_fn
    ray.init(
        address=args.address or "local", logging_level="ERROR", **({} if args.address else {"include_dashboard": False})
    )
    steps = args.epochs * args.samples // 128
    tuner = tune.Tuner(
        raympi.tune.trainable(train_fn, workers=args.workers),
        param_space={
            "lr": tune.loguniform(1e-4, 3e-2),
            "hidden": tune.choice([64, 128, 256]),
            "workers": args.workers,
            "epochs": args.epochs,
            "samples": args.samples,
            "data_dir": os.path.abspath(args.data_dir),  # a trial runs in its own directory
        },
        tune_config=tune.TuneConfig(
            metric="eval_loss",
            mode="min",
            num_samples=args.trials,
            scheduler=ASHAScheduler(time_attr="step", max_t=steps, grace_period=50, reduction_factor=2),
        ),
        run_config=RunConfig(storage_path=args.storage, name="fashion-mnist", verbose=1),
    )
    results = tuner.fit()
    done = [r for r in results if "step" in r.metrics]  # a trial stopped (Ctrl-C) before its first report has none
    for result in sorted(done, key=lambda r: r.metrics.get("eval_loss", float("inf"))):
        m = result.metrics
        print(
            f"lr {result.config['lr']:.2e} hidden {result.config['hidden']:>3}: step {m['step']:>4} "
            f"eval_loss {m['eval_loss']:.4f} eval_accuracy {m.get('eval_accuracy', float('nan')):.3f}"
        )
    if len(done) < len(results):
        print(f"{len(results) - len(done)} trial(s) reported nothing (stopped before their first step)")
    if not done:
        return
    best = min(done, key=lambda r: r.metrics["eval_loss"])
    print(f"best: lr {best.config['lr']:.2e} hidden {best.config['hidden']}, checkpoint {best.checkpoint.path}")


if __name__ == "__main__":
    main()
