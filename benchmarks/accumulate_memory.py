"""Peak memory of one training step with gradient accumulation (``accumulate=k``) against without.

Each setting runs in a fresh process (peak RSS is a high-water mark): an MLP with wide hidden
layers, one rank's share of a large global batch, 3 steps of ``make_train_step``; printed: the
peak RSS growth over the state and data already in memory, and the step time.

    python benchmarks/accumulate_memory.py            # batch 4096 per rank, accumulate 1, 2, 4, 8
    python benchmarks/accumulate_memory.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, resource, sys, time, torch
sys.path.insert(0, sys.argv[3])
from torch import nn
from raympi import TrainState, make_train_step, optim
torch.set_num_threads(1)
batch, k = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10))
x, y = torch.randn(batch, 256), torch.randint(0, 10, (batch,))
opt = optim.sgd(0.01)
state = TrainState.create(model, opt)
step = make_train_step(model, nn.functional.cross_entropy, opt, accumulate=k, donate=True)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
times = []
for _ in range(3):
    t = time.perf_counter()
    state, m = step(state, (x, y))
    times.append(time.perf_counter() - t)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_growth_mb": (peak - base) / 1024, "step_s": sorted(times)[1], "loss": m["loss"]}))
"""


def measure(batch: int, k: int) -> dict:
    root = str(Path(__file__).resolve().parents[1])
    # Every large block straight from mmap and back on free: the peak RSS is then the peak of live memory
    # (glibc's default keeps freed blocks, and its dynamic threshold differs between the settings).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**16), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(batch), str(k), root], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4096, help="samples per rank per step")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    batch = 256 if args.quick else args.batch
    ks = [1, 4] if args.quick else [1, 2, 4, 8]
    rows = {k: measure(batch, k) for k in ks}
    print(f"one rank, MLP 256-4096-4096-10 (17.9M params), {batch} samples per step, SGD; fresh process per row")
    print("| accumulate | peak RSS growth during the step (MB) | vs accumulate=1 | step (s) | loss after 3 steps |")
    print("|---|---|---|---|---|")
    for k, r in rows.items():
        print(
            f"| {k} | {r['peak_growth_mb']:.0f} | {r['peak_growth_mb'] / max(1e-9, rows[1]['peak_growth_mb']):.2f}x "
            f"| {r['step_s']:.3f} | {r['loss']:.5f} |"
        )


if __name__ == "__main__":
    main()
