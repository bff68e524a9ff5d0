"""glibc's malloc arenas and the step: page faults and allreduce time with and without ``MALLOC_ARENA_MAX=1``.

A raympi worker runs its step on a Ray thread, not the main one (the actor has a concurrency group for
health checks).  glibc gives such a thread an arena of its own, made of 64 MB mmapped heaps that it
shrinks when their top is freed, so that each step's fresh gradients may be faulted in again.  Here:
two ranks (Ray actors with a concurrency group, as raympi's workers), one MPI communicator, the step
``fit`` runs (``make_train_step(..., grad_sync=comm.allreduce_, donate=True)``) on the 5.8M MLP, 32
samples per rank, SGD.  Each run starts a fresh pair of processes (the arena a thread gets is decided
in its process), the settings interleaved.  Per run, rank medians over the timed steps: the whole
step, its allreduce, and the minor page faults a step (``/proc/self/stat``).  Both settings keep
``fit``'s other two malloc settings (mmap threshold 64 MB, no trimming).

    python benchmarks/malloc_arenas.py             # 3 runs of each setting, 200 timed steps
    python benchmarks/malloc_arenas.py --quick     # 1 run each, 30 steps
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
import torch
import torch.nn.functional as F

import raympi
from raympi import comm
from raympi.core.state import TrainState
from raympi.core.step import make_train_step
from raympi.driver.config import MPIConfig
from raympi.driver.group import CPU_MALLOC_ENV

from _common import mlp, start_local_ray

# fit's malloc settings for CPU workers, with and without its one arena
SETTINGS = {
    "glibc default": {k: v for k, v in CPU_MALLOC_ENV.items() if k != "MALLOC_ARENA_MAX"},
    "MALLOC_ARENA_MAX=1": CPU_MALLOC_ENV,
}


def _minor_faults() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


@ray.remote(num_cpus=1, concurrency_groups={"health": 1})
class Rank(comm.Member):
    def steps(self, n: int, warmup: int) -> tuple[float, float, float]:
        """(step ms, allreduce ms, minor page faults a step): medians over ``n`` steps after ``warmup``."""
        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = mlp()
        opt = raympi.optim.sgd(0.01)
        sync_ms: list[float] = []

        def timed_sync(tree):
            start = time.perf_counter()
            self.comm.allreduce_(tree)
            sync_ms.append((time.perf_counter() - start) * 1e3)

        step = make_train_step(model, F.cross_entropy, opt, grad_sync=timed_sync, rank=self.comm.rank, donate=True)
        state = TrainState.create(model, opt)
        g = torch.Generator().manual_seed(self.comm.rank)
        x, y = torch.randn(640, 784, generator=g), torch.randint(0, 10, (640,), generator=g)
        step_ms, faults = [], []
        for i in range(warmup + n):
            idx = torch.randint(0, 640, (32,), generator=g)
            f0, start = _minor_faults(), time.perf_counter()
            state, _ = step(state, (x[idx], y[idx]), 64)
            step_ms.append((time.perf_counter() - start) * 1e3)
            faults.append(_minor_faults() - f0)
        return (
            statistics.median(step_ms[warmup:]),
            statistics.median(sync_ms[warmup:]),
            statistics.median(faults[warmup:]),
        )


def run(setting: str, steps: int) -> tuple[float, float, float]:
    """One fresh pair of ranks under ``setting``: the slower rank's step and allreduce, the mean faults."""
    env = {**MPIConfig().environment(multi_host=False), "OMP_NUM_THREADS": "1", **SETTINGS[setting]}
    ranks = [Rank.options(runtime_env={"env_vars": env}).remote() for _ in range(2)]
    try:
        comm.form(ranks, timeout_s=120)
        res = ray.get([r.steps.remote(steps, 10) for r in ranks], timeout=600)
    finally:
        for r in ranks:
            ray.kill(r)
    return max(r[0] for r in res), max(r[1] for r in res), statistics.mean(r[2] for r in res)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="1 run of each setting, 30 steps")
    args = parser.parse_args()
    runs, steps = (1, 30) if args.quick else (args.runs, args.steps)
    start_local_ray(2, log_to_driver=False)
    rows = []
    for i in range(runs):
        for setting in SETTINGS if i % 2 == 0 else reversed(list(SETTINGS)):
            ms, ar, faults = run(setting, steps)
            print(f"# run {i} {setting}: {ms:.2f} ms/step, allreduce {ar:.2f} ms, {faults:.1f} faults/step", flush=True)
            rows.append((setting, i, ms, ar, faults))
    ray.shutdown()
    print(f"\n5.8M MLP, 2 ranks, 32 samples each, {steps} timed steps a run; per run the slower rank's medians")
    print(f"{'setting':<20} | {'run':>3} | {'ms/step':>8} | {'allreduce ms':>12} | {'page faults/step':>16}")
    print("-" * 72)
    for setting, i, ms, ar, faults in sorted(rows, key=lambda r: (list(SETTINGS).index(r[0]), r[1])):
        print(f"{setting:<20} | {i:>3} | {ms:>8.2f} | {ar:>12.2f} | {faults:>16.1f}")
    for setting in SETTINGS:
        mine = [r for r in rows if r[0] == setting]
        print(
            f"  {setting}: median {statistics.median(r[2] for r in mine):.2f} ms/step, "
            f"allreduce {statistics.median(r[3] for r in mine):.2f} ms, "
            f"{statistics.median(r[4] for r in mine):.1f} faults/step"
        )


if __name__ == "__main__":
    main()
