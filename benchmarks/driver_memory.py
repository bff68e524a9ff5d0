"""The driver's memory and start time with a large map-style Dataset: neither should grow with the data.

A lazily generated Dataset (sample ``i`` is a 1x28x28 float32 image drawn from a generator seeded by
``i`` and the label ``i % 10``; nothing is stored, the object pickles to a few hundred bytes) of
several nominal sizes (samples x 3,136 bytes), trained with ``raympi.fit(Net(), dataset, workers=2,
max_steps=5, batch_size=64)`` (the CNN of examples/mnist.py).  For each fit:

    RSS growth   the driver process's peak resident set size during ``fit()`` minus its RSS just
                 before the call (psutil, sampled every 2 ms in a thread; Ray already running)
    start s      from the ``fit()`` call to the end of the first step (``result.metrics[0]["time"]``)

One fresh local Ray per fit (``ray.init`` is outside both figures).  Sizes run interleaved run by run;
before them one untimed fit on the smallest size imports and warms up what every fit then finds ready
(its figures are printed as "cold"). A control row trains on the same number of samples as the smallest
size given as in-memory tensors (materialized on the driver and put into the object store): it shows
what the instrument sees when the data do pass through the driver.

Run:
    python benchmarks/driver_memory.py                   # 40 MB and 4 GB nominal, 3 runs each (~3 min)
    python benchmarks/driver_memory.py --sizes 40MB,4GB,40GB --runs 5
    python benchmarks/driver_memory.py --quick           # 4 MB and 400 MB, 1 run, no warm-up fit (tests); one
                                                         # Ray, every fit in the first one's workers

Writes benchmarks/out/driver_memory.csv (every fit) and benchmarks/out/driver_memory.txt (the table);
driver_memory_quick.* with --quick.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")

import psutil  # noqa: E402
import torch  # noqa: E402

from _common import (  # noqa: E402
    attempt,
    fresh_ray,
    keep_workers,
    median_range,
    mnist_example,
    rotated,
    save_results,
    share_one_ray,
)

WORLD = 2
BATCH = 64
STEPS = 5
SAMPLE_BYTES = 1 * 28 * 28 * 4
UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
CONTROL = "tensors (control)"


class LazyImages(torch.utils.data.Dataset):
    """``n`` MNIST-shaped samples generated from their index; nothing is stored."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(int(i))
        return torch.randn(1, 28, 28, generator=g), int(i) % 10


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]B)\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"size {text!r}: write e.g. 40MB or 4GB")
    return int(float(m.group(1)) * UNITS[m.group(2)])


def human(nbytes: float) -> str:
    for unit in ("TB", "GB", "MB", "KB"):
        if nbytes >= UNITS[unit]:
            return f"{nbytes / UNITS[unit]:g} {unit}"
    return f"{nbytes:g} B"


class PeakRSS:
    """The peak RSS of this process while the block runs, sampled in a thread."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.proc, self.interval_s = psutil.Process(), interval_s
        self.stop = threading.Event()
        self.base = self.peak = 0

    def _sample(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self.stop.wait(self.interval_s)

    def __enter__(self) -> "PeakRSS":
        gc.collect()
        self.base = self.peak = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self.after = self.proc.memory_info().rss


def one_fit(dataset: Any, tmp: str) -> dict[str, Any]:
    """One fit on a fresh local Ray: RSS growth (peak - before) and seconds from the call to the first step."""
    import raympi

    with fresh_ray(WORLD):
        torch.manual_seed(0)
        model = mnist_example().Net()
        with PeakRSS() as rss:
            start = time.time()
            result = raympi.fit(
                model,
                dataset,
                workers=WORLD,
                epochs=1,
                max_steps=STEPS,
                batch_size=BATCH,
                progress=False,
                torch_threads=1,
                checkpoint_dir=tempfile.mkdtemp(dir=tmp),
                checkpoint_every=0,
                keep_workers=keep_workers(),
            )
        if [r["step"] for r in result.metrics] != list(range(1, STEPS + 1)):
            raise RuntimeError(f"fit reported steps {[r['step'] for r in result.metrics]}")
        return {
            "rss_growth_mb": (rss.peak - rss.base) / 2**20,
            "rss_kept_mb": (rss.after - rss.base) / 2**20,
            "start_s": result.metrics[0]["time"] - start,
            "total_s": result.metrics[-1]["time"] - start,
        }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="40MB,4GB", help="nominal dataset sizes, comma-separated (samples x 3,136 bytes)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--no-control", action="store_true", help="skip the in-memory tensors row")
    p.add_argument("--quick", action="store_true", help="4 MB and 400 MB, 1 run, no warm-up fit")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.runs = "4MB,400MB", 1
        share_one_ray(WORLD)  # a smoke run: one Ray for every fit
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    cases: dict[str, Any] = {human(s): LazyImages(max(BATCH, s // SAMPLE_BYTES)) for s in sizes}
    if not args.no_control:
        n = len(cases[human(sizes[0])])
        g = torch.Generator().manual_seed(0)
        cases[CONTROL] = (torch.randn(n, 1, 28, 28, generator=g), torch.arange(n) % 10)
    torch.set_num_threads(1)

    rows: list[dict[str, Any]] = []
    failed = False
    with tempfile.TemporaryDirectory(prefix="raympi-drvmem-") as tmp:
        if not args.quick:
            warm = one_fit(LazyImages(len(cases[human(sizes[0])])), tmp)
            print(
                f"# cold (first fit in this process, imports included, not in the table): RSS growth "
                f"{warm['rss_growth_mb']:.1f} MB, start {warm['start_s']:.2f} s",
                file=sys.stderr,
                flush=True,
            )
        names = list(cases)
        for run in range(args.runs):
            for name in rotated(names, run):
                data = cases[name]
                n = len(data[1]) if isinstance(data, tuple) else len(data)
                row: dict[str, Any] = {
                    "run": run,
                    "case": name,
                    "samples": n,
                    "rss_growth_mb": None,
                    "rss_kept_mb": None,
                    "start_s": None,
                    "total_s": None,
                    "error": "",
                }
                failed |= not attempt(row, lambda: one_fit(data, tmp))
                rows.append(row)
                got = (
                    f"RSS +{row['rss_growth_mb']:.1f} MB, start {row['start_s']:.2f} s"
                    if not row["error"]
                    else row["error"]
                )
                print(f"# run {run} {name}: {got}", file=sys.stderr, flush=True)

    stem = "driver_memory_quick" if args.quick else "driver_memory"  # a smoke run leaves the full run's files alone
    save_results(stem, rows, _table(rows, list(cases), args))
    if failed:
        print("FAILED: a fit errored (see above)")
    return 1 if failed else 0


def _table(rows: list[dict[str, Any]], names: list[str], args: argparse.Namespace) -> str:
    lines = [
        f"driver during raympi.fit(Net(), dataset, workers={WORLD}, max_steps={STEPS}, batch_size={BATCH}); "
        f"{args.runs} run(s) interleaved, medians (min-max); lazy = generated from the index, nothing stored",
        f"{'dataset':28} | {'samples':>10} | {'peak RSS growth MB':>22} | {'RSS kept MB':>20} | "
        f"{'fit() to step 1 s':>20}",
    ]
    lines.append("-" * len(lines[-1]))
    by_name: dict[str, dict[str, list[float]]] = {}
    for name in names:
        mine = [r for r in rows if r["case"] == name and not r["error"]]
        by_name[name] = {k: [r[k] for r in mine] for k in ("rss_growth_mb", "rss_kept_mb", "start_s")}
        label = f"in-memory {name}" if name == CONTROL else f"lazy, {name} nominal"
        n = next(r["samples"] for r in rows if r["case"] == name)
        lines.append(
            f"{label:28} | {n:>10,} | {median_range(by_name[name]['rss_growth_mb'], '6.1f'):>22} | "
            f"{median_range(by_name[name]['rss_kept_mb'], '5.1f'):>20} | "
            f"{median_range(by_name[name]['start_s'], '5.2f'):>20}"
        )
    lazy = [n for n in names if n != CONTROL and by_name[n]["rss_growth_mb"]]
    if lazy:
        worst = max(statistics.median(by_name[n]["rss_growth_mb"]) for n in lazy)
        lines += [
            "",
            "targets (medians of this run)",
            f"  peak RSS growth, largest over the lazy sizes: {worst:.1f} MB "
            f"(target < 200 MB: {'met' if worst < 200 else 'not met'})",
        ]
        if len(lazy) > 1:
            small, big = statistics.median(by_name[lazy[0]]["start_s"]), statistics.median(by_name[lazy[-1]]["start_s"])
            lines.append(
                f"  start {lazy[-1]} / {lazy[0]}: {big:.2f} s / {small:.2f} s = {big / small:.2f}x "
                f"(target: not growing with size, i.e. within the run-to-run spread)"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
