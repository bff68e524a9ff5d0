"""Train a small CNN on MNIST or Fashion-MNIST with raympi.fit.

    python examples/mnist.py                          # local Ray, 2 workers, Fashion-MNIST
    python examples/mnist.py --augment                # random crop + flip, redrawn every epoch, read on the workers
    python examples/mnist.py --address auto --workers 8   # on a cluster from `ray up cluster.yaml`

With no internet, the data come from --data-dir or from Debian's
`dataset-fashion-mnist` package (/usr/share/datasets/fashion-mnist).
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import sys
import time

import torch
from torch import nn

import raympi

DEBIAN_FASHION = "/usr/share/datasets/fashion-mnist"
FILES = [
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
]


class Net(nn.Module):
    """The CNN of the classic data-parallel template, slimmed to 108k parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 5 * 5, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class WideNet(nn.Module):
    """A wider CNN (0.4M parameters) for the augmented run: augmentation pays off with more capacity."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Dropout(0.3), nn.Linear(64 * 7 * 7, 96), nn.ReLU(), nn.Linear(96, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


MEAN_STD = {"fashion-mnist": (0.2860, 0.3530), "mnist": (0.1307, 0.3081)}


def augmented(name: str, data_dir: str) -> torch.utils.data.Dataset:
    """The training set as a torchvision Dataset with random crop (padding 2) and horizontal flip.

    raympi reads it on the workers and seeds each read from (seed, epoch, sample): a fresh
    augmentation every epoch, the same on any number of workers.
    """
    from torchvision import transforms

    mean, std = MEAN_STD[name]
    flip = [transforms.RandomHorizontalFlip()] if name == "fashion-mnist" else []  # digits are not mirror-symmetric
    augment = transforms.Compose(
        [transforms.RandomCrop(28, padding=2), *flip, transforms.ToTensor(), transforms.Normalize((mean,), (std,))]
    )
    return _torchvision(name, data_dir, train=True, transform=augment)


def _torchvision(name: str, data_dir: str, train: bool, transform=None):
    from torchvision import datasets

    cls = datasets.FashionMNIST if name == "fashion-mnist" else datasets.MNIST
    raw = os.path.join(data_dir, cls.__name__, "raw")
    if name == "fashion-mnist" and os.path.isdir(DEBIAN_FASHION):
        os.makedirs(raw, exist_ok=True)
        for f in FILES:  # torchvision reads the unpacked IDX files and then skips its download
            target = os.path.join(raw, f.removesuffix(".gz"))
            if not os.path.exists(target) and os.path.exists(os.path.join(DEBIAN_FASHION, f)):
                with gzip.open(os.path.join(DEBIAN_FASHION, f)) as src, open(target + ".part", "wb") as dst:
                    shutil.copyfileobj(src, dst)
                os.replace(target + ".part", target)
    try:
        return cls(data_dir, train=train, download=True, transform=transform)
    except Exception as exc:  # no internet and no local copy
        sys.exit(
            f"mnist.py: cannot get {name} ({type(exc).__name__}: {exc}).\n"
            f"Put the four IDX .gz files ({', '.join(FILES)}) in {raw}, pass --data-dir, or for Fashion-MNIST "
            f"install Debian's copy: apt-get install dataset-fashion-mnist"
        )


def load(name: str, data_dir: str, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(images, labels) as float32 (N, 1, 28, 28) normalized and int64 (N,), from torchvision's reader."""
    ds = _torchvision(name, data_dir, train)
    mean, std = MEAN_STD[name]
    return ds.data.unsqueeze(1).float().div_(255).sub_(mean).div_(std), ds.targets.long()


def main(argv: list[str] | None = None) -> raympi.Result:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=None, help="default 4, or 12 with --augment")
    parser.add_argument("--augment", action="store_true", help="random crop + flip on a wider CNN, read by the workers")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--dataset", choices=["mnist", "fashion-mnist"], default="fashion-mnist")
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--address", default=None, help="Ray cluster address ('auto'); default: a local Ray instance")
    parser.add_argument("--checkpoint-dir", default="runs/mnist")
    parser.add_argument("--checkpoint-every", type=int, default=200)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--subset", type=int, default=0, help="use only the first N training and N/5 test samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compression", choices=["bf16", "fp16"], default=None, help="gradients as 16-bit floats on the wire"
    )
    parser.add_argument(
        "--precision", choices=["fp32", "bf16", "fp16"], default="fp32", help="mixed precision of forward and loss"
    )
    args = parser.parse_args(argv)

    epochs = args.epochs or (12 if args.augment else 4)
    x_train, y_train = load(args.dataset, args.data_dir, train=True)
    x_test, y_test = load(args.dataset, args.data_dir, train=False)
    train: object = (x_train, y_train)
    if args.augment:
        train = augmented(args.dataset, args.data_dir)
    if args.subset:
        train = (
            torch.utils.data.Subset(train, range(args.subset))
            if args.augment
            else (x_train[: args.subset], y_train[: args.subset])
        )
        x_test, y_test = x_test[: max(1, args.subset // 5)], y_test[: max(1, args.subset // 5)]

    torch.manual_seed(args.seed)
    start = time.time()
    steps = epochs * (len(train if args.augment else x_train) // args.batch_size)
    try:
        result = raympi.fit(
            WideNet() if args.augment else Net(),
            train,
            workers=args.workers,
            epochs=epochs,
            batch_size=args.batch_size,
            optimizer=raympi.optim.adam(raympi.optim.cosine_decay(args.lr, steps)),
            eval_dataset=(x_test, y_test),
            seed=args.seed,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every,
            resume=args.resume,
            address=args.address,
            compression=args.compression,
            precision=args.precision,
        )
    except raympi.RaympiError as exc:  # one line: what went wrong and what to change
        sys.exit(f"mnist.py: {type(exc).__name__}: {exc}")
    with torch.no_grad():
        accuracy = (result.model.eval()(x_test).argmax(1) == y_test).float().mean().item()
    print(
        f"{args.dataset}: test accuracy {accuracy:.4f} after {epochs} epoch(s) on {args.workers} worker(s), "
        f"{time.time() - start:.1f} s; last checkpoint {result.checkpoint}"
    )
    return result


if __name__ == "__main__":
    main()
