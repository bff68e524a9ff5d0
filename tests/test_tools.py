"""The tools that are not benchmarks run end to end: the GPU check's CPU mode, the suite's CPU sampler, the cost
model (tools/README.md).  The GPU carry's build has its own module, tests/test_gpu_carry.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import time_limits
from test_benchmarks import _run as run_script

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, args: list[str], timeout: int, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``tools/<script> <args>`` (``env``: added to the environment); it must exit 0."""
    return run_script(script, args, timeout, env, folder="tools")


def test_gpu_check_cpu_mode_smoke(tmp_path):
    """tools/gpu_check.py --cpu: the script, its guards, the world-of-one process-group step and the
    gradient syncs run on CPU (gloo standing in for NCCL) and write JSON; the steps match no sync bit for bit.
    A stage that overruns its limit (parity, given 3 s: stopped while it starts its fits) is stopped there, its process
    group killed, and the stages after it still run on the same Ray."""
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "gpu_check.py"),
            "--cpu",
            "--stages",
            "env,parity,nccl1,sync",
            "--limit",
            "parity=3",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=time_limits.limit_s(240),  # on 2 quiet cores, stretched by the load
        env={**os.environ, "OUT": str(tmp_path)},
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads((tmp_path / "gpu_check_cpu.json").read_text())
    stages = report["stages"]
    assert {k: v["status"] for k, v in stages.items()} == {
        "env": "ok",
        "parity": "timeout",
        "nccl1": "ok",
        "sync": "ok",
    }, proc.stdout
    assert stages["parity"]["limit_s"] == 3 and stages["parity"]["seconds"] < 20, stages["parity"]
    assert stages["env"]["result"]["workers' NCCL environment"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert stages["nccl1"]["result"]["all_match"] is True, proc.stdout
    rows = stages["sync"]["result"]["rows"]
    assert [r["transport"] for r in rows] == ["mpi", "gloo"] and all(
        r["1 MB tree"] > 0 and r["8 MB buckets"] > 0 for r in rows
    ), rows


def test_suite_cpu_quick():
    """tools/suite_cpu.py --quick --by SUITE_CPU_PROBE: the command's exit status and wall time, and its own
    process counted in the table with the CPU its `import torch` took, and again by the variable it inherited."""
    proc = _run("suite_cpu.py", ["--quick", "--by", "SUITE_CPU_PROBE"], 120, env={"SUITE_CPU_PROBE": "probe"})
    assert re.search(r"-c import torch: exit 0, [0-9.]+ s wall", proc.stdout), proc.stdout
    row = re.search(r"^python \(other\)\s+\|\s+(\d+) \|\s+([0-9.]+) \|", proc.stdout, re.M)
    assert row and int(row.group(1)) >= 1 and float(row.group(2)) > 0.2, proc.stdout
    probe = re.search(r"^probe\s+\|\s+1 \|\s+([0-9.]+) \|", proc.stdout, re.M)  # the command, and nothing else
    assert probe and float(probe.group(1)) > 0.2, proc.stdout
    assert re.search(r"^probe\s+1 x python \(other\): \d+$", proc.stdout, re.M), proc.stdout


def test_cost_model_prints_its_table_and_its_constants_sources():
    """tools/cost_model.py: arithmetic only, instant; every constant names where it comes from."""
    table = _run("cost_model.py", [], 60).stdout
    assert re.search(r"^\| ResNet-50 \| 8 \| gradients, `nccl` \|", table, re.M), table
    constants = json.loads(_run("cost_model.py", ["--json"], 60).stdout)["constants"]
    assert constants and all(c["source"] for c in constants.values()), constants
