"""An ImageFolder of PNG files and a timm model: raympi against torchrun + DDP + DataLoader(num_workers=1).

Fashion-MNIST written once as PNG files (``benchmarks/out/fashion-png/<class>/<n>.png``), read by
torchvision's ``ImageFolder`` with Grayscale + RandomCrop(28, padding=2) + RandomHorizontalFlip +
ToTensor + Normalize; timm's resnet18 (1 input channel, 10 classes), the same initial weights; SGD
lr 0.01, global batch 128 (64 per rank), 2 ranks, 1 torch thread each, CPU.  Contenders, interleaved
run by run (the order rotated each run):

    raympi lw=0       raympi.fit on the ImageFolder, loader_workers=0: decoded in the step's thread
                      (the default with one CPU per worker)
    raympi lw=1       the same, one forked reading process per worker, prefetching
    torchrun-ddp      torchrun --standalone --nproc_per_node 2, DDP over gloo, each rank
                      DataLoader(ImageFolder, 64, DistributedSampler, num_workers=1)

Steady samples/s over the steps after the warm-up (raympi from its records' driver-observed times,
torchrun's ranks between two barriers).

    python benchmarks/imagefolder.py                 # 3 runs x 3 contenders, 120 steps (20 warm-up), 20,000 images
    python benchmarks/imagefolder.py --quick         # 1 run, 2,048 images, 8 steps (2 warm-up); one Ray,
                                                     # raympi's contenders in one set of workers

Writes benchmarks/out/imagefolder.csv and .txt (imagefolder_quick.* with --quick).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from _common import (  # noqa: E402
    OUT,
    ROOT,
    SEED,
    add_child_options,
    attempt,
    dataloader_loop,
    ddp,
    fit_throughput,
    median_range,
    mnist_example,
    read_spec,
    rotated,
    run_torchrun,
    save_results,
    share_one_ray,
    torchrun_gloo,
    write_spec,
)

WORLD, PER_RANK, LR = 2, 64, 0.01
GLOBAL = WORLD * PER_RANK
CONTENDERS = ("raympi-lw0", "raympi-lw1", "torchrun-ddp")


def image_folder(root: str) -> Any:
    """The training ImageFolder with its random transforms (the same for every contender)."""
    from torchvision import datasets, transforms

    augment = transforms.Compose(
        [
            transforms.Grayscale(),
            transforms.RandomCrop(28, padding=2),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize((0.2860,), (0.3530,)),
        ]
    )
    return datasets.ImageFolder(root, transform=augment)


def resnet18() -> torch.nn.Module:
    import timm

    return timm.create_model("resnet18", pretrained=False, num_classes=10, in_chans=1)


def write_pngs(folder: Path, data_dir: str, count: int) -> None:
    """The first ``count`` Fashion-MNIST training images as PNG files in ImageFolder's layout (once)."""
    done = folder / f".complete-{count}"
    if done.exists():
        return
    from PIL import Image

    raw = mnist_example()._torchvision("fashion-mnist", data_dir, train=True)
    for i in range(count):
        label = raw.classes[int(raw.targets[i])].replace("/", "-")
        (folder / label).mkdir(parents=True, exist_ok=True)
        Image.fromarray(raw.data[i].numpy()).save(folder / label / f"{i:05d}.png")
    done.touch()


def _ddp_rank(spec: dict[str, Any]) -> None:
    """A torchrun rank: DataLoader(ImageFolder, num_workers=1) + DDP, timed between barriers."""
    torch.set_num_threads(1)
    with torchrun_gloo() as (rank, world, barrier):
        model = resnet18()
        model.load_state_dict(torch.load(spec["init"], weights_only=True))
        dataloader_loop(spec, rank, world, ddp(model), barrier, image_folder(spec["images"]), PER_RANK)


def run_raympi(spec: dict[str, Any], loader_workers: int) -> dict[str, Any]:
    model = resnet18()
    model.load_state_dict(torch.load(spec["init"], weights_only=True))
    dataset = image_folder(spec["images"])
    return fit_throughput(model, dataset, len(dataset), spec, WORLD, GLOBAL, LR, loader_workers)


def run_contender(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    if name == "torchrun-ddp":
        res = run_torchrun(__file__, spec, WORLD)
        return {"samples_per_s": 1000 * GLOBAL / res["ms_per_step"], "start_s": res["launch_s"]}
    return run_raympi(spec, loader_workers=int(name[-1]))


def table(rows: list[dict[str, Any]], contenders: list[str], images: int) -> str:
    def sps(c: str) -> list[float]:
        return [r["samples_per_s"] for r in rows if r["contender"] == c and r["samples_per_s"] is not None]

    ddp_runs = sps("torchrun-ddp")
    lines = [
        f"timm resnet18 on an ImageFolder of {images:,} PNGs, global batch {GLOBAL}, {WORLD} ranks, "
        f"{max(r['run'] for r in rows) + 1} interleaved run(s)",
        "",
        f"{'contender':<14} {'steady samples/s: median (min-max)':>36} {'vs DDP':>7} {'start s':>8}",
    ]
    for c in contenders:
        mine = sps(c)
        ratio = (
            f"{sorted(mine)[len(mine) // 2] / sorted(ddp_runs)[len(ddp_runs) // 2]:.2f}x" if mine and ddp_runs else "-"
        )
        starts = [r["start_s"] for r in rows if r["contender"] == c and r["start_s"] is not None]
        lines.append(f"{c:<14} {median_range(mine, '6.1f'):>36} {ratio:>7} {median_range(starts, '4.1f'):>8}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--images", type=int, default=20000)
    p.add_argument("--data-dir", default=str(ROOT / "data"))
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--quick", action="store_true", help="1 run, 2,048 images, 8 steps (2 warm-up)")
    add_child_options(p)
    args = p.parse_args(argv)
    if args.child:
        _ddp_rank(read_spec(args.spec))
        return 0
    if args.quick:
        args.runs, args.steps, args.warmup, args.images = 1, 8, 2, 2048
        share_one_ray(WORLD)  # a smoke run: one Ray for every contender
    contenders = [c for c in args.contenders.split(",") if c]
    if any(c not in CONTENDERS for c in contenders) or not 1 <= args.warmup < args.steps:
        p.error(f"contenders are {CONTENDERS}; need 1 <= warmup < steps")
    folder = OUT / f"fashion-png-{args.images}"
    write_pngs(folder, args.data_dir, args.images)
    tmp = Path(tempfile.mkdtemp(prefix="raympi-imagefolder-"))
    torch.manual_seed(SEED)
    init = str(tmp / "init.pt")
    torch.save(resnet18().state_dict(), init)
    rows: list[dict[str, Any]] = []
    try:
        for run in range(args.runs):
            for name in rotated(contenders, run):
                spec = write_spec(
                    tmp, f"{run}-{name}", init=init, images=str(folder), steps=args.steps, warmup=args.warmup, lr=LR
                )
                row: dict[str, Any] = {
                    "run": run,
                    "contender": name,
                    "samples_per_s": None,
                    "start_s": None,
                    "error": "",
                }
                attempt(row, lambda: run_contender(name, spec))
                rows.append(row)
                got = f"{row['samples_per_s']:.1f} samples/s" if row["samples_per_s"] is not None else row["error"]
                print(f"# run {run} {name}: {got}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    save_results("imagefolder_quick" if args.quick else "imagefolder", rows, table(rows, contenders, args.images))
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
