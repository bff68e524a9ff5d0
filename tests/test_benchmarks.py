"""The benchmarks run end to end (their quick modes) and print their tables."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_recovery_benchmark_quick():
    """benchmarks/recovery.py --quick: one killed raympi worker, recovered, and a numeric row in the table."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "recovery.py"), "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert re.search(r"^scenario\s+\|\s+median s\s+\|\s+min s\s+\|\s+max s", proc.stdout, re.M), proc.stdout
    row = re.search(r"^raympi killed worker \((?:warm|cold)\)\s+\|\s+([0-9.]+)\s+\|\s+([0-9.]+)\s+\|\s+([0-9.]+)\s+\|\s+1\s+\|", proc.stdout, re.M)
    assert row, proc.stdout
    assert 0 < float(row.group(1)) < 120


def test_compare_quick():
    """benchmarks/compare.py --quick: raympi, the mpiexec template and the floor run; the template ends with raympi's parameters."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert re.search(r"^model\s+\|\s+W\s+\|\s+contender\s+\|\s+min\s+\|\s+median\s+\|\s+max\s+\|\s+ratio\s+\|", proc.stdout, re.M), proc.stdout
    assert re.search(r"^cnn\s+\|\s+2\s+\|\s+raympi\s+\|\s+[0-9.]+\s+\|.*\|\s+ref\s*$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^cnn\s+\|\s+2\s+\|\s+mpiexec-template\s+\|\s+[0-9.]+\s+\|.*\|\s+PASS\b", proc.stdout, re.M), proc.stdout
    assert re.search(r"^cnn\s+\|\s+2\s+\|\s+floor\s+\|\s+[0-9.]+\s+\|", proc.stdout, re.M), proc.stdout
    assert (ROOT / "benchmarks" / "out" / "compare.csv").exists() and (ROOT / "benchmarks" / "out" / "compare.png").exists()
