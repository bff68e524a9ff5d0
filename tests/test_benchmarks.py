"""The benchmarks run end to end (their quick modes) and print their tables."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import time_limits

ROOT = Path(__file__).resolve().parents[1]


def _quick(script: str, timeout: int) -> subprocess.CompletedProcess:
    """Run ``benchmarks/<script> --quick``; it must exit 0."""
    return _run(script, ["--quick"], timeout)


def _run(
    script: str, args: list[str], timeout: int, env: dict[str, str] | None = None, folder: str = "benchmarks"
) -> subprocess.CompletedProcess:
    """Run ``<folder>/<script> <args>`` (``env``: added to the environment); it must exit 0 within ``timeout``
    seconds on 2 quiet cores, stretched by the load (tests/time_limits.py)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / folder / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=time_limits.limit_s(timeout),
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc


def test_comm_benchmark_quick():
    """benchmarks/comm_bench.py --quick: formation and a 1 MB allreduce, MPI next to gloo."""
    proc = _quick("comm_bench.py", 180)
    assert re.search(r"^\s+2 formation\s+[0-9.]+ms\s+[0-9.]+ms", proc.stdout, re.M), proc.stdout
    assert re.search(r"^\s+2 allreduce 1 MB\s+[0-9.]+ms\s+[0-9.]+ms\s+[0-9.]+GB/s", proc.stdout, re.M), proc.stdout


def test_profile_step_quick():
    """benchmarks/profile_step.py --quick: the phases of one step at 2 ranks."""
    proc = _quick("profile_step.py", 180)
    assert re.search(r"^cnn \(examples/mnist.py\)\s+108,618(\s+-?[0-9.]+){6}", proc.stdout, re.M), proc.stdout


# slow: ~14 s; recovery itself is tested by tests/test_elastic.py
@pytest.mark.slow
def test_recovery_benchmark_quick():
    """benchmarks/recovery.py --quick: one killed raympi worker, recovered, and a numeric row in the table."""
    proc = _quick("recovery.py", 240)
    assert re.search(r"^scenario\s+\|\s+median s\s+\|\s+min s\s+\|\s+max s", proc.stdout, re.M), proc.stdout
    row = re.search(
        r"^raympi killed worker \((?:warm|cold)\)\s+\|\s+([0-9.]+)\s+\|\s+([0-9.]+)\s+\|\s+([0-9.]+)\s+\|\s+1\s+\|",
        proc.stdout,
        re.M,
    )
    assert row, proc.stdout
    assert 0 < float(row.group(1)) < 120


# slow: ~45 s (a 4-node Ray cluster, two fits, torchrun); the eviction itself is tested by tests/test_elastic.py
@pytest.mark.slow
def test_stragglers_quick():
    """benchmarks/stragglers.py --quick: raympi, raympi with one rank slowed and eviction on, and torchrun + DDP
    slowed each get a throughput; the eviction run says where the straggler was found, or that it was not."""
    proc = _quick("stragglers.py", 240)
    for name in ("raympi", "raympi slowed, eviction on", r"torchrun \+ DDP slowed"):
        assert re.search(rf"^{name}\s+\|\s+[0-9]+ \([0-9]+-[0-9]+\) \|", proc.stdout, re.M), proc.stdout
    found = r"^raympi slowed, eviction on, run 1: (the straggler found at step \d+|no eviction)"
    assert re.search(found, proc.stdout, re.M), proc.stdout


def test_compare_quick():
    """benchmarks/compare.py --quick: raympi, the mpiexec template, the floor and the raw allreduce run; the template
    ends with raympi's parameters."""
    proc = _quick("compare.py", 300)
    assert re.search(
        r"^model\s+\|\s+W\s+\|\s+contender\s+\|\s+min\s+\|\s+median\s+\|\s+max\s+\|\s+ratio\s+\|", proc.stdout, re.M
    ), proc.stdout
    assert re.search(r"^cnn\s+\|\s+2\s+\|\s+raympi\s+\|\s+[0-9.]+\s+\|.*\|\s+ref\s*$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^cnn\s+\|\s+2\s+\|\s+mpiexec-template\s+\|\s+[0-9.]+\s+\|.*\|\s+PASS\b", proc.stdout, re.M), (
        proc.stdout
    )
    assert re.search(r"^cnn\s+\|\s+2\s+\|\s+floor\s+\|\s+[0-9.]+\s+\|", proc.stdout, re.M), proc.stdout
    assert (ROOT / "benchmarks" / "out" / "compare.csv").exists() and (
        ROOT / "benchmarks" / "out" / "compare.png"
    ).exists()
    assert re.search(r"^cnn\s+\|\s+2\s+\|\s+raw-allreduce\s+\|\s+[0-9.]+\s+\|.*\|\s+n/a", proc.stdout, re.M), (
        proc.stdout
    )
    # The figures are printed (whether a target is met is the full benchmark's business, not a smoke run's).
    assert re.search(
        r"^  cnn W=2: raympi [0-9.]+ ms,\s+[0-9.]+x mpiexec-template .*\s+"
        r"[0-9.]+x floor [0-9.]+ \+ raw allreduce [0-9.]+ ms \(Ray actors, fit's transport, p10-p90 [0-9.]+-[0-9.]+\)",
        proc.stdout,
        re.M,
    ), proc.stdout


# slow: ~15 s; fit with checkpoints is covered throughout tests/test_fit.py and tests/test_checkpoint.py
@pytest.mark.slow
def test_fit_overhead_quick():
    """benchmarks/fit_overhead.py --quick: fit, fit with checkpoints, fit in kept workers and the driverless
    workers all step."""
    proc = _quick("fit_overhead.py", 240)
    for mode in ("workers only", "fit", r"fit \+ ckpt/20", "fit, kept"):
        assert re.search(
            rf"^cnn\s+\|\s+{mode}\s+\|\s+[0-9.]+\s+\|\s+[0-9.]+\s+\|\s+[0-9.]+\s+\|\s+[0-9.]+", proc.stdout, re.M
        ), proc.stdout


# slow: ~55 s (Ray Train and torchrun start up); fit on augmented datasets is covered by tests/test_data.py
@pytest.mark.slow
def test_data_benchmark_quick():
    """benchmarks/data.py --quick: raympi on the augmented Dataset (both loader settings), the cheap transform,
    the in-memory tensors, torchrun + DDP and Ray Train each train and get a throughput."""
    proc = _quick("data.py", 600)
    assert re.search(
        r"^contender\s+\|\s+what\s+\|\s+min\s+\|\s+median\s+\|\s+max\s+\|\s+x ref\s+\|\s+start s", proc.stdout, re.M
    ), proc.stdout
    for name in ("raympi-tv-lw0", "raympi-tv-lw1", "raympi-torch-op", "raympi-tensors", "torchrun-ddp", "raytrain"):
        assert re.search(
            rf"^{name}\s+\|[^|]+\|\s+[0-9]+\s+\|\s+[0-9]+\s+\|\s+[0-9]+\s+\|\s+[0-9.]+\s+\|\s+[0-9.]+\s*$",
            proc.stdout,
            re.M,
        ), proc.stdout
    assert re.search(r"^  raympi-tv-lw0: [0-9.]+x torchrun-DDP's throughput", proc.stdout, re.M), proc.stdout
    assert (ROOT / "benchmarks" / "out" / "data_quick.csv").exists() and (
        ROOT / "benchmarks" / "out" / "data_quick.txt"
    ).exists()


@pytest.mark.slow
def test_imagefolder_benchmark_quick():
    """benchmarks/imagefolder.py --quick: timm's resnet18 on an ImageFolder of PNGs, raympi (both loader
    settings) and torchrun + DDP each train and get a throughput and a ratio to DDP's."""
    pytest.importorskip("timm")
    proc = _quick("imagefolder.py", 600)
    for name in ("raympi-lw0", "raympi-lw1", "torchrun-ddp"):
        row = rf"^{name}\s+[0-9.]+ \(\s*[0-9.]+-\s*[0-9.]+\)\s+[0-9.]+x\s+[0-9.]+ \(\s*[0-9.]+-\s*[0-9.]+\)\s*$"
        assert re.search(row, proc.stdout, re.M), proc.stdout
    assert (ROOT / "benchmarks" / "out" / "imagefolder_quick.csv").exists()


def test_scale_quick():
    """benchmarks/scale.py --quick: light members form and reduce; the driver's CPU per chunk with instant workers."""
    proc = _quick("scale.py", 180)
    for n in (2, 4):
        assert re.search(
            rf"^\s+{n} |\s+[0-9.]+ \|\s+[0-9.]+ \|\s+[0-9.]+ \|\s+[0-9.]+ \|\s+[0-9.]+ \|\s+[0-9.]+ \|",
            proc.stdout,
            re.M,
        ), proc.stdout
    assert re.search(
        r"^  alpha-beta at N=2 \(not oversubscribed\): latency \(8 B allreduce\) [0-9.]+ us", proc.stdout, re.M
    ), proc.stdout
    for k in (1, 4):
        assert re.search(
            rf"^\s+4 \|\s+{k} \|\s+\d+ \|\s+[0-9.]+ \|\s+[0-9.]+ \|\s+[0-9.]+ \|\s+[0-9.]+ \|\s+\d+% \|\s+\d+%",
            proc.stdout,
            re.M,
        ), proc.stdout


def test_shard_quick():
    """benchmarks/shard.py --quick: unsharded, sharded and sharded with buddy copies side by side at 1 and 2 ranks;
    at 2 ranks each rank's optimizer state is half the unsharded one, and with the buddy copy all of it (the
    table's ratio column)."""
    proc = _quick("shard.py", 300)
    ratios = {
        int(m.group(1)): [float(x) for x in m.group(2).split(" / ")]
        for m in re.finditer(r"^\| (\d) \|[^|]+\|[^|]+\| ([0-9. /]+) \|", proc.stdout, re.M)
    }
    assert ratios == {1: [1.0], 2: [0.5, 1.0]}, proc.stdout
