"""Training time blocked by checkpoints of a large state: rank 0 writing it vs the driver writing it.

A bias-free MLP of ``--layers`` square ``Linear(d, d)`` layers (``--mb`` of float32 parameters in all),
plain SGD (no optimizer state), trained by ``raympi.fit`` on ``--workers`` rank(s) for ``--steps`` steps
with a checkpoint every ``--every`` steps, three ways, interleaved run by run:

    direct   direct_checkpoint_bytes=1: rank 0 copies its state and writes it in a background thread
    driver   direct_checkpoint_bytes=None: rank 0 hands its state to the driver (object store), which writes it
    none     checkpoint_every=0: only the final checkpoint (after the last timed step): the baseline

Figures per checkpoint (mid-run checkpoints only; the final one comes after the last timed step):

    blocked s    the duration of the chunk of steps right after a checkpoint (rank 0 serves the checkpoint
                 request between it and the chunk before) minus its steps at the run's median seconds a step
    overhead s   (time from step 2 to the last step) minus the same for the 'none' run, per checkpoint:
                 blocking plus whatever the background write takes from the steps (CPU, memory bandwidth)
    copy s       direct only: rank 0's copy of its state (from the manifest; the blocking part)
    write s      direct only: rank 0's background write, copy to fsync (from the manifest)

Checkpoints go to a fresh folder under ``--dir`` (default: the system's temp folder), deleted after each run.

Run:
    python benchmarks/checkpoint_large.py            # 1 GB state, 1 worker, 37 steps, 3 mid-run checkpoints (~4 min)
    python benchmarks/checkpoint_large.py --workers 2 --runs 3
    python benchmarks/checkpoint_large.py --quick    # 64 MB, 1 run (tests)

Writes benchmarks/out/checkpoint_large.csv (every run) and benchmarks/out/checkpoint_large.txt (the table);
checkpoint_large_quick.* with --quick.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from _common import OMP1, OUT, local_ray, write_csv  # noqa: E402

WAYS = {
    "direct": {"direct_checkpoint_bytes": 1},
    "driver": {"direct_checkpoint_bytes": None},
    "none": {"direct_checkpoint_bytes": None, "checkpoint_every": 0},
}


def _model(mb: float, layers: int) -> nn.Module:
    d = int((mb * 2**20 / 4 / layers) ** 0.5)
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(d, d, bias=False) for _ in range(layers)])


def _one(way: str, args: argparse.Namespace) -> dict[str, Any]:
    import raympi

    model = _model(args.mb, args.layers)
    d = model[0].in_features
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(args.batch * 4, d, generator=g), torch.randint(0, d, (args.batch * 4,), generator=g))
    folder = tempfile.mkdtemp(prefix="raympi-ckpt-", dir=args.dir)
    options = dict(
        epochs=args.steps,
        max_steps=args.steps,
        batch_size=args.batch,
        optimizer=raympi.optim.sgd(1e-3),
        checkpoint_every=args.every,
        keep_checkpoints=args.steps // args.every + 1,
        progress=False,
        checkpoint_dir=folder,
        step_timeout_s=120.0,
        startup_timeout_s=300.0,
        spares=0,
    )
    options.update(WAYS[way])
    try:
        result = raympi.fit(model, data, workers=args.workers, **options)
        times = [r["time"] for r in result.metrics]
        manifests = [
            json.loads((Path(folder) / n / "manifest.json").read_text())
            for n in sorted(os.listdir(folder))
            if n.startswith("step-")
        ]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    # Steps of one chunk share its completion time: a chunk is (its first step, its steps, its seconds).
    ends = [s for s in range(2, len(times) + 1) if s == len(times) or times[s] != times[s - 1]]
    chunks = [(a + 1, b - a, times[b - 1] - times[a - 1]) for a, b in zip(ends, ends[1:])]  # from step 3 on
    marks = set(range(args.every, args.steps, args.every)) if way != "none" else set()
    after = [c for c in chunks if c[0] - 1 in marks]  # the chunk that waited for the checkpoint request
    usual = statistics.median(sec / n for first, n, sec in chunks if (first, n, sec) not in after)
    mid = [m for m in manifests if m["step"] < args.steps and "copy_s" in m]
    return {
        "way": way,
        "state_mb": sum(p.numel() for p in model.parameters()) * 4 / 2**20,
        "span_s": times[-1] - times[1],
        "checkpoints": len(marks),
        "step_s": usual,
        "blocked_s": statistics.mean(sec - n * usual for _, n, sec in after) if after else 0.0,
        "blocked_each": " ".join(f"{sec - n * usual:.2f}" for _, n, sec in after),
        "copy_each": " ".join(f"{m['copy_s']:.2f}" for m in mid),
        "copy_s": statistics.mean(m["copy_s"] for m in mid) if mid else None,
        "write_s": statistics.mean(m["write_s"] for m in mid) if mid else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=1024.0, help="state size in MiB (float32 parameters)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=37)
    parser.add_argument("--every", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (a fresh folder per run)")
    parser.add_argument("--quick", action="store_true", help="64 MB, 12 steps, 1 run")
    args = parser.parse_args()
    if args.quick:
        args.mb, args.steps, args.every, args.runs = 64.0, 12, 4, 1
    rows = []
    with local_ray(max(2, args.workers), env=OMP1):
        for run in range(args.runs):
            for way in WAYS:
                row = {"run": run, **_one(way, args)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    base = {r["run"]: r["span_s"] for r in rows if r["way"] == "none"}
    for r in rows:
        r["overhead_s"] = (r["span_s"] - base[r["run"]]) / r["checkpoints"] if r["checkpoints"] else 0.0
    suffix = "_quick" if args.quick else ""
    write_csv(OUT / f"checkpoint_large{suffix}.csv", rows)

    def cell(way: str, key: str) -> str:
        values = [r[key] for r in rows if r["way"] == way and r[key] is not None]
        return (
            "-"
            if not values
            else f"{statistics.median(values):.3f}"
            + (f" ({min(values):.3f}-{max(values):.3f})" if len(values) > 1 else "")
        )

    for r in rows:
        if r["way"] != "none":
            print(
                f"{r['way']} run {r['run']}: blocked s per checkpoint {r['blocked_each']}; "
                f"rank 0's copy s {r['copy_each'] or '-'}"
            )
    lines = [
        f"state {rows[0]['state_mb']:.0f} MiB, {args.workers} worker(s), {args.steps} steps, a checkpoint every "
        f"{args.every}, {args.runs} run(s) each; median (min-max) seconds",
        "",
        "| path | step s | blocked s / checkpoint | overhead s / checkpoint | copy s | write s |",
        "|---|---|---|---|---|---|",
    ]
    for way in WAYS:
        lines.append(
            f"| {way} | {cell(way, 'step_s')} | {cell(way, 'blocked_s') if way != 'none' else '-'} | "
            f"{cell(way, 'overhead_s') if way != 'none' else '-'} | {cell(way, 'copy_s')} | {cell(way, 'write_s')} |"
        )
    table = "\n".join(lines)
    (OUT / f"checkpoint_large{suffix}.txt").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    sys.exit(main())
