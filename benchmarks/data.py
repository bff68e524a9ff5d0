"""Training throughput on real data with augmentation: raympi reading a Dataset against DDP's DataLoader.

Fashion-MNIST (60,000 training images), the CNN of examples/mnist.py (``Net``, 108,618 parameters),
2 workers, global batch 64 (32 per worker), SGD lr 0.01, 1 torch thread per rank, CPU, the same
initial weights and the same number of steps for everyone.  Contenders, interleaved run by run
(the order rotated each run):

    raympi tv lw=0     raympi.fit on examples/mnist.py's ``augmented`` Dataset (torchvision FashionMNIST,
                       RandomCrop(28, padding=2) + RandomHorizontalFlip + ToTensor + Normalize),
                       loader_workers=0: samples read in the step's own thread (the default at 1 CPU/worker)
    raympi tv lw=1     the same with loader_workers=1: one forked reading process per worker, prefetching
    raympi torch-op    raympi.fit on a Dataset of the in-memory uint8 images doing the same crop + flip +
                       normalize with torch ops (no PIL): a cheap transform, loader_workers=0
    raympi tensors     raympi.fit on the in-memory (images, labels) tensors, no augmentation: the reference
                       a cheap transform should come close to (the in-memory fast path, gathered by index)
    torchrun-ddp       torchrun --standalone --nproc_per_node 2, DDP over gloo, each rank
                       DataLoader(augmented, batch_size=32, sampler=DistributedSampler, num_workers=1)
    raytrain           Ray Train TorchTrainer (2 workers, prepare_model: DDP over gloo), the same DataLoader

Throughput is the steady state: samples/s over the steps after the warm-up (start-up excluded).  The
torchrun and Ray Train ranks time it themselves, between two barriers; raympi from the driver-observed
times of its metrics records (the records of a chunk are all stamped when it arrives, microseconds apart:
from the arrival of the chunk holding step ``--warmup`` to that of the last step).  "start s": from the
contender's start (the ``fit()`` call, ``trainer.fit()``, the torchrun launch) to the end of rank 0's first
step; Ray's own start (``ray.init``, one fresh local Ray per raympi / Ray Train run, as in compare.py) is not
included.

Augmentations differ in their random draws between frameworks (raympi seeds each sample from
(seed, epoch, index); DistributedSampler shuffles differently), so parameters are not compared here:
compare.py checks that the steps themselves agree.

Run:
    python benchmarks/data.py                     # 3 runs x 6 contenders, 400 steps (50 warm-up): ~6-10 min on 2 cores
    python benchmarks/data.py --runs 5 --steps 600
    python benchmarks/data.py --quick             # 1 run, a 2,048-image subset, 20 steps (5 warm-up): a smoke test
                                                  # (one Ray; raympi's contenders in one set of workers)

Writes benchmarks/out/data.csv (every run) and benchmarks/out/data.txt (the table); data_quick.* with --quick.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _common import (  # noqa: E402  (benchmarks/_common.py: what the benchmarks share)
    LR,
    PER_WORKER,
    ROOT,
    SEED,
    add_child_options,
    attempt,
    dataloader_loop,
    ddp,
    example_defs,
    fit_throughput,
    fmt,
    median_or_none,
    min_median_max,
    mnist_example,
    raytrain_ddp,
    read_spec,
    rotated,
    save_results,
    share_one_ray,
    torchrun_gloo,
    write_spec,
)
from _common import run_raytrain as _run_raytrain  # noqa: E402
from _common import run_torchrun as _run_torchrun  # noqa: E402

WORLD = 2
GLOBAL = PER_WORKER * WORLD  # 32 per rank, global batch 64
DATASET = "fashion-mnist"

CONTENDERS = ("raympi-tv-lw0", "raympi-tv-lw1", "raympi-torch-op", "raympi-tensors", "torchrun-ddp", "raytrain")
LABELS = {
    "raympi-tv-lw0": "raympi, torchvision aug, loader_workers=0",
    "raympi-tv-lw1": "raympi, torchvision aug, loader_workers=1",
    "raympi-torch-op": "raympi, torch-op aug Dataset (cheap)",
    "raympi-tensors": "raympi, in-memory tensors, no aug",
    "torchrun-ddp": "torchrun + DDP, DataLoader num_workers=1",
    "raytrain": "Ray Train, DataLoader num_workers=1",
}
REFERENCE = "raympi-tv-lw0"


# ---------------------------------------------------------------- the workload
# (driver, torchrun ranks, Ray Train workers)


def subset(dataset: Any, n: int) -> Any:
    return torch.utils.data.Subset(dataset, range(n)) if n else dataset


class TorchOpAugment(torch.utils.data.Dataset):
    """The same augmentation as examples/mnist.py's ``augmented`` in torch ops on in-memory images.

    Random crop 28 of the image zero-padded by 2, horizontal flip with probability 1/2, then
    ``x / 255``, normalized: what RandomCrop + RandomHorizontalFlip + ToTensor + Normalize do, without PIL.
    The images are padded once, here, as uint8 (N, 32, 32).
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean: float, std: float, padding: int = 2) -> None:
        self.padded = F.pad(images, (padding,) * 4)  # (N, 28, 28) uint8 -> (N, 32, 32), zeros around
        self.labels, self.mean, self.std, self.size = labels, mean, std, images.shape[-1]
        self.span = 2 * padding + 1

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        top, left = torch.randint(0, self.span, (2,)).tolist()
        img = self.padded[i, top : top + self.size, left : left + self.size]
        if torch.rand(()) < 0.5:
            img = img.flip(-1)
        return img.unsqueeze(0).float().div_(255).sub_(self.mean).div_(self.std), self.labels[i]


def _dataloader_loop(
    spec: dict[str, Any], rank: int, world: int, model: torch.nn.Module, barrier: Callable[[], None]
) -> None:
    """DDP's side: DataLoader(augmented, 32, DistributedSampler, num_workers=1), SGD; timed between barriers."""
    torch.set_num_threads(1)
    dataset = subset(example_defs()["augmented"](DATASET, spec["data_dir"]), spec["subset"])
    dataloader_loop(spec, rank, world, model, barrier, dataset, spec["per_worker"])


def _child_model(spec: dict[str, Any]) -> torch.nn.Module:
    model = example_defs()["Net"]()
    model.load_state_dict(torch.load(spec["init"], weights_only=True))
    return model


def _child(mode: str, spec_path: str) -> None:
    """A torchrun rank (this file run with --child ddp)."""
    if mode != "ddp":
        raise SystemExit(f"unknown child mode {mode!r}")
    spec = read_spec(spec_path)
    torch.set_num_threads(1)
    with torchrun_gloo() as (rank, world, barrier):
        _dataloader_loop(spec, rank, world, ddp(_child_model(spec)), barrier)


def _raytrain_loop(spec: dict[str, Any]) -> None:
    """Ray Train's train_loop_per_worker: prepare_model wraps the model in DDP (gloo, set up by TorchTrainer)."""
    torch.set_num_threads(1)
    model, rank, world, barrier = raytrain_ddp(_child_model(spec))
    _dataloader_loop(spec, rank, world, model, barrier)


# ---------------------------------------------------------------- the contenders, seen from the driver


class Inputs:
    """What the driver prepares once: initial weights, the datasets of the raympi rows."""

    def __init__(self, tmp: Path, data_dir: str, n: int) -> None:
        mnist = mnist_example()
        torch.manual_seed(SEED)
        model = mnist.Net()
        self.params = sum(p.numel() for p in model.parameters())
        self.init = str(tmp / "init.pt")
        torch.save(model.state_dict(), self.init)
        self.augmented = subset(mnist.augmented(DATASET, data_dir), n)  # also unpacks the IDX files for the children
        self.tensors = mnist.load(DATASET, data_dir, train=True)
        raw = mnist._torchvision(DATASET, data_dir, train=True)
        mean, std = mnist.MEAN_STD[DATASET]
        images, labels = raw.data, raw.targets.long()
        if n:
            self.tensors = (self.tensors[0][:n], self.tensors[1][:n])
            images, labels = images[:n], labels[:n]
        self.torch_op = TorchOpAugment(images, labels, mean, std)
        self.length = len(self.tensors[1])


def run_raympi(name: str, spec: dict[str, Any], inputs: Inputs) -> dict[str, Any]:
    dataset, loader_workers = {
        "raympi-tv-lw0": (inputs.augmented, 0),
        "raympi-tv-lw1": (inputs.augmented, 1),
        "raympi-torch-op": (inputs.torch_op, 0),
        "raympi-tensors": (inputs.tensors, None),
    }[name]
    torch.set_num_threads(1)
    model = mnist_example().Net()
    model.load_state_dict(torch.load(spec["init"], weights_only=True))
    return fit_throughput(model, dataset, inputs.length, spec, WORLD, GLOBAL, LR, loader_workers)


def run_torchrun(spec: dict[str, Any]) -> dict[str, Any]:
    res = _run_torchrun(__file__, spec, WORLD)
    return {"samples_per_s": 1000 * GLOBAL / res["ms_per_step"], "start_s": res["launch_s"]}


def run_raytrain(spec: dict[str, Any]) -> dict[str, Any]:
    res = _run_raytrain(_raytrain_loop, spec, WORLD, "data")
    return {"samples_per_s": 1000 * GLOBAL / res["ms_per_step"], "start_s": res["launch_s"]}


def run_contender(name: str, spec: dict[str, Any], inputs: Inputs) -> dict[str, Any]:
    if name == "torchrun-ddp":
        return run_torchrun(spec)
    if name == "raytrain":
        return run_raytrain(spec)
    return run_raympi(name, spec, inputs)


# ---------------------------------------------------------------- driver


def _summarize(rows: list[dict[str, Any]], contenders: list[str]) -> list[dict[str, Any]]:
    ref = [r["samples_per_s"] for r in rows if r["contender"] == REFERENCE and r["samples_per_s"] is not None]
    out = []
    for c in contenders:
        mine = [r for r in rows if r["contender"] == c]
        sps = [r["samples_per_s"] for r in mine if r["samples_per_s"] is not None]
        start = [r["start_s"] for r in mine if r["start_s"] is not None]
        stats = min_median_max(sps)
        out.append(
            {
                "contender": c,
                **stats,
                "ratio": stats["median"] / statistics.median(ref) if sps and ref else None,
                "start": median_or_none(start),
                "errors": sum(1 for r in mine if r["error"]),
            }
        )
    return out


def _table(summary: list[dict[str, Any]], args: argparse.Namespace, inputs: Inputs) -> str:
    lines = [
        f"samples/s over steps {args.warmup + 1}-{args.steps} "
        f"({args.steps - args.warmup} timed after {args.warmup} warm-up), {args.runs} run(s) interleaved; "
        f"Fashion-MNIST {inputs.length:,}, CNN {inputs.params:,} params, {WORLD} workers, global batch {GLOBAL}, "
        f"SGD, 1 torch thread/rank; x ref = median / median of '{REFERENCE}'",
    ]
    header = f"{'contender':16} | {'what':42} | {'min':>7} | {'median':>7} | {'max':>7} | {'x ref':>5} | {'start s':>7}"
    lines += [header, "-" * len(header)]
    for s in summary:
        err = f" ({s['errors']} failed)" if s["errors"] else ""
        lines.append(
            f"{s['contender']:16} | {LABELS[s['contender']]:42} | {fmt(s['min'], '7.0f')} | "
            f"{fmt(s['median'], '7.0f')} | {fmt(s['max'], '7.0f')} | {fmt(s['ratio'], '5.2f')} | "
            f"{fmt(s['start'], '7.2f')}{err}"
        )
    med = {s["contender"]: s["median"] for s in summary if s["median"]}
    lines += ["", "targets (medians of this run)"]
    for mine in ("raympi-tv-lw0", "raympi-tv-lw1", "raympi-torch-op"):
        if mine not in med:
            continue
        parts = []
        if "torchrun-ddp" in med:
            r = med[mine] / med["torchrun-ddp"]
            parts.append(f"{r:.2f}x torchrun-DDP's throughput (target >= 1.30x: {'met' if r >= 1.3 else 'not met'})")
        if "raytrain" in med:
            parts.append(f"{med[mine] / med['raytrain']:.2f}x Ray Train's")
        if "raympi-tensors" in med:
            r = med[mine] / med["raympi-tensors"]
            parts.append(f"{r:.2f}x the in-memory tensors (within 10 %: {'met' if r >= 0.9 else 'not met'})")
        lines.append(f"  {mine}: " + ", ".join(parts))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=400, help="steps per run, warm-up included")
    p.add_argument("--warmup", type=int, default=50, help="steps not timed")
    p.add_argument("--subset", type=int, default=0, help="use only the first N training images (0: all 60,000)")
    p.add_argument(
        "--data-dir", default=str(ROOT / "data"), help="torchvision's data folder (Fashion-MNIST from Debian's package)"
    )
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--quick", action="store_true", help="1 run, 2,048 images, 20 steps (5 warm-up)")
    add_child_options(p)
    args = p.parse_args(argv)
    if args.child:
        _child(args.child, args.spec)
        return 0
    if args.quick:
        args.runs, args.steps, args.warmup, args.subset = 1, 20, 5, 2048
        share_one_ray(WORLD)  # a smoke run: one Ray for every contender
    contenders = [c for c in args.contenders.split(",") if c]
    bad = [c for c in contenders if c not in CONTENDERS]
    if bad or args.warmup < 1 or args.steps <= args.warmup:
        p.error(f"unknown contenders {bad}" if bad else "need 1 <= warmup < steps")
    torch.set_num_threads(1)

    tmp = Path(tempfile.mkdtemp(prefix="raympi-data-"))
    rows: list[dict[str, Any]] = []
    try:
        inputs = Inputs(tmp, args.data_dir, args.subset)
        print(f"# {inputs.length:,} images, {inputs.params:,} parameters", file=sys.stderr)
        for run in range(args.runs):
            for name in rotated(contenders, run):  # who goes first rotates, so drifts in machine speed spread out
                tag = f"{run}-{name}"
                spec = write_spec(
                    tmp,
                    tag,
                    init=inputs.init,
                    data_dir=args.data_dir,
                    subset=args.subset,
                    per_worker=PER_WORKER,
                    lr=LR,
                    steps=args.steps,
                    warmup=args.warmup,
                )
                row: dict[str, Any] = {
                    "run": run,
                    "contender": name,
                    "samples_per_s": None,
                    "start_s": None,
                    "error": "",
                }
                began = time.time()
                attempt(
                    row, lambda: run_contender(name, spec, inputs)
                )  # an error is recorded, reported, and the exit status says so
                rows.append(row)
                got = f"{row['samples_per_s']:.0f} samples/s" if row["samples_per_s"] is not None else row["error"]
                print(f"# run {run} {name}: {got} ({time.time() - began:.1f} s)", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    stem = "data_quick" if args.quick else "data"  # a smoke run leaves the full run's files alone
    save_results(stem, rows, _table(_summarize(rows, contenders), args, inputs))
    failed = any(r["error"] for r in rows)
    if failed:
        print("FAILED: a contender errored (see above)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
