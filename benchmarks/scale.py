"""Many ranks on one machine: light members' formation and allreduce, and the driver's own load per chunk.

(a) Light members (Ray actors in which ``import torch`` fails, ``num_cpus=0``) form one communicator of
    N ranks and sum float32 arrays of 8 B, 1 MB and 16 MB with ``Communicator.allreduce_array_``
    (median over reps of the slowest rank), under the one-host MPI environment ``fit`` uses
    (``MPIConfig().environment(multi_host=False)``).  N far above the core count is oversubscribed:
    the absolute times say how 2 cores time-share N processes, only the trend against N means anything.
(b) The driver's CPU time (``time.process_time``: every thread of the driver process, Ray's included)
    per chunk of k steps with W workers that answer at once: raympi's real ``Pipeline`` (chunk
    planning, the ``Sampler``'s index shards, one ``run.remote`` per rank) and ``WorkerGroup.gather``
    (deadlines, per-rank checks), against light actors that count the steps and return.

    python benchmarks/scale.py              # (a) N = 2, 8, 16, 32, 64; (b) W = 8, 32, 128 (~6 min)
    python benchmarks/scale.py --part a     # only (a); --part b only (b)
    python benchmarks/scale.py --quick      # (a) N = 2, 4; (b) W = 4 (a smoke run)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import socket
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import ray

from raympi import comm
from raympi.driver.config import MPIConfig, parse_config
from raympi.driver.data import Sampler
from raympi.driver.group import WorkerGroup
from raympi.driver.pipeline import ChunkPlan, Pipeline
from raympi.worker.results import ChunkResult

from _common import OMP1, slowest_median, start_local_ray, time_reps

# (a)'s members: torch cannot be imported from the interpreter's start.
LIGHT_BOOT = (
    "import sys\n"
    "class _NoTorch:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'torch' or name.startswith('torch.'):\n"
    "            raise ImportError('No module named torch (blocked: a light member)')\n"
    "sys.meta_path.insert(0, _NoTorch())\n"
)
BATCH = 1024  # global batch of (b): 8 samples a rank at W = 128


@ray.remote(num_cpus=0)
class Light(comm.Member):
    """A rank with no torch: forms, then times ``allreduce_array_``."""

    def torch_loaded(self) -> bool:
        return "torch" in sys.modules

    def init_mpi(self) -> None:
        """MPI_Init ahead of formation (formation would do it in its first round), to time the two apart."""
        from raympi.comm import library

        library.init()

    def time_allreduce(self, nbytes: int, reps: int) -> list[float]:
        x = np.ones(max(1, nbytes // 4), dtype=np.float32)
        return time_reps(self.comm.barrier, lambda: self.comm.allreduce_array_(x), reps)  # the first is a warm-up


@ray.remote(num_cpus=0)
class Echo:
    """A worker that does no work: answers ``run`` at once with one metrics record per step."""

    def run(self, steps: list, global_batch_size: int) -> ChunkResult:
        return ChunkResult([{"loss": 0.0}] * len(steps), 0)

    def state_dict(self) -> dict:
        return {}

    def ping(self) -> int:
        return os.getpid()


class EchoGroup(WorkerGroup):
    """``WorkerGroup``'s own ``gather`` and checks over :class:`Echo` actors (no placement group, no MPI)."""

    def __init__(self, cfg: Any, actors: list[Any]) -> None:  # noqa: D107
        cpu = types.SimpleNamespace(device="cpu", torch_threads=1)  # what a group reads of a WorkerSpec (no torch here)
        super().__init__(cfg, len(actors), cpu, None)  # never started: the actors are there
        self.actors, self.hosts = actors, [socket.gethostname()] * len(actors)
        self.cpu_s = 0.0  # driver CPU spent in gather
        self.fresh = False  # its processes have run steps before (the warm-up run)

    def join_spares(self) -> None:
        """No hot spares here: nothing joins the standby communicator."""

    def gather(self, *args: Any, **kwargs: Any) -> list[Any]:
        start = time.process_time()
        try:
            return super().gather(*args, **kwargs)
        finally:
            self.cpu_s += time.process_time() - start


class TimedPipeline(Pipeline):
    """The real pipeline, counting the driver CPU spent in ``submit`` (shards, pickling, one call per rank)."""

    cpu_s = 0.0

    def submit(self, group: Any, first: int, count: int) -> Any:
        start = time.process_time()
        try:
            return super().submit(group, first, count)
        finally:
            self.cpu_s += time.process_time() - start


@dataclasses.dataclass(frozen=True)
class FixedPlan(ChunkPlan):
    """The real plan with chunks of ``chunk`` steps (the real one grows them to 0.5 s of work)."""

    chunk: int = 1

    def next_size(self, step: int, last_count: int, last_seconds: float) -> int:
        return min(self.chunk, self.boundary(step) - step)


class Hooks:
    """The controller's hooks, reduced to keeping the records."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def completed(self, chunk: Any, records: list[dict[str, Any]]) -> None:
        self.records.extend(records)

    def save(self, state_ref: Any, step: int) -> None:
        ray.get(state_ref)

    def draining(self, stop: Any) -> None:
        pass


def _boot_dir(files: dict[str, str]) -> str:
    root = Path(tempfile.mkdtemp(prefix="raympi-scale-"))
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return str(root)


def _ready(actors: list[Any]) -> float:
    start = time.perf_counter()
    ray.get([a.__ray_ready__.remote() for a in actors])
    return time.perf_counter() - start


def part_a(sizes: list[int], sizes_16mb: set[int], reps: int) -> list[dict[str, Any]]:
    env = {
        **MPIConfig().environment(multi_host=False),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": _boot_dir({"sitecustomize.py": LIGHT_BOOT}),
    }
    rows = []
    for n in sizes:
        actors = [Light.options(runtime_env={"env_vars": env}).remote() for _ in range(n)]
        try:
            row: dict[str, Any] = {"N": n, "start_s": _ready(actors)}
            assert not any(ray.get([a.torch_loaded.remote() for a in actors])), "a light member imported torch"
            start = time.perf_counter()
            ray.get([a.init_mpi.remote() for a in actors])
            row["init_s"] = time.perf_counter() - start
            start = time.perf_counter()
            comm.form(actors, timeout_s=300)
            row["form_s"] = time.perf_counter() - start
            for label, nbytes in (("8B", 8), ("1MB", 2**20), ("16MB", 16 * 2**20)):
                if label == "16MB" and n not in sizes_16mb:
                    continue
                per_rank = ray.get(
                    [a.time_allreduce.remote(nbytes, reps if nbytes < 2**24 else max(3, reps // 4)) for a in actors]
                )
                row[label] = slowest_median(per_rank)
            assert not any(ray.get([a.torch_loaded.remote() for a in actors])), "a collective imported torch"
        finally:
            for a in actors:
                ray.kill(a, no_restart=True)
        rows.append(row)
        print(f"  N={n}: {row}", flush=True)
    return rows


def part_b(worlds: list[int], chunks: list[int], steps: int) -> list[dict[str, Any]]:
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": _boot_dir({"sitecustomize.py": LIGHT_BOOT})}  # indices come as numpy
    rows = []
    for w in worlds:
        actors = [Echo.options(runtime_env={"env_vars": env}).remote() for _ in range(w)]
        try:
            start_s = _ready(actors)
            cfg = parse_config(workers=w, batch_size=BATCH)
            group = EchoGroup(cfg, actors)
            for k in chunks:
                total = max(4 * k, steps - steps % k)
                plan = FixedPlan(
                    total=total + 1, steps_per_epoch=total + 1, chunk=k
                )  # one epoch; +1: the first chunk is 1 step
                sampler = Sampler(0, BATCH, BATCH * (total + 1), range(w, w + 1))
                pipeline = TimedPipeline(plan, sampler, cfg, eval_size=0)
                pipeline.run(group, 0, Hooks(), lambda: None)  # warm-up: every actor's connection, the epoch's order
                hooks, pipeline.cpu_s, group.cpu_s = Hooks(), 0.0, 0.0
                wall, cpu = time.perf_counter(), time.process_time()
                pipeline.run(group, 0, hooks, lambda: None)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                assert len(hooks.records) == total + 1
                n_chunks = 1 + total // k
                rows.append(
                    {
                        "W": w,
                        "k": k,
                        "start_s": start_s,
                        "chunks": n_chunks,
                        "steps": total + 1,
                        "cpu_chunk_ms": cpu / n_chunks * 1e3,
                        "cpu_step_ms": cpu / (total + 1) * 1e3,
                        "wall_chunk_ms": wall / n_chunks * 1e3,
                        "cpu_share": cpu / wall,
                        "submit": pipeline.cpu_s / cpu,
                        "gather": group.cpu_s / cpu,
                    }
                )
                print(f"  W={w} k={k}: {rows[-1]}", flush=True)
        finally:
            for a in actors:
                ray.kill(a, no_restart=True)
    return rows


def print_a(rows: list[dict[str, Any]], cores: int) -> None:
    print(
        f"\n(a) light members, {cores} cores, MPI env {MPIConfig().environment(multi_host=False)}; "
        "median of the slowest rank"
    )
    ref = next((r for r in rows if r["N"] >= 8), rows[-1])
    n0, lg0 = ref["N"], math.log2(max(2, ref["N"]))
    print(
        f"{'N':>3} | {'start s':>7} | {'init s':>6} | {'form s':>7} | {'form/N ms':>9} | {'8 B ms':>7} | "
        f"{'1 MB ms':>8} | {'16 MB ms':>8} | {'form x':>6} | {'1 MB x':>6} | {'log2N x':>7} | {'N log2N x':>9}"
    )
    for r in rows:
        n, lg = r["N"], math.log2(max(2, r["N"]))
        mb16 = f"{r['16MB'] * 1e3:8.1f}" if "16MB" in r else f"{'-':>8}"
        print(
            f"{n:>3} | {r['start_s']:7.1f} | {r['init_s']:6.2f} | {r['form_s']:7.2f} | {r['form_s'] / n * 1e3:9.1f} | "
            f"{r['8B'] * 1e3:7.2f} | {r['1MB'] * 1e3:8.2f} | {mb16} | {r['form_s'] / ref['form_s']:6.2f} | "
            f"{r['1MB'] / ref['1MB']:6.2f} | {lg / lg0:7.2f} | {n * lg / (n0 * lg0):9.2f}"
        )
    print(
        "  init: MPI_Init on every rank at once (fit does it inside formation's first round); form: comm.form after it"
    )
    print(
        f"  'x' columns are ratios to N={n0}: measured (form, 1 MB) against a log2(N) algorithm with a core per rank "
        f"(log2N) and the same algorithm time-sharing {cores} cores (N log2N)"
    )
    top = rows[-1]
    if top["N"] > n0:
        span = math.log(top["N"] / n0)
        print(
            f"  from N={n0} to {top['N']}: formation ~ N^{math.log(top['form_s'] / ref['form_s']) / span:.2f}, "
            f"1 MB allreduce ~ N^{math.log(top['1MB'] / ref['1MB']) / span:.2f}, "
            f"8 B ~ N^{math.log(top['8B'] / ref['8B']) / span:.2f} "
            f"(log2N model: N^{math.log(math.log2(top['N']) / lg0) / span:.2f}, "
            f"N log2N: N^{math.log(top['N'] * math.log2(top['N']) / (n0 * lg0)) / span:.2f})"
        )
    two = next((r for r in rows if r["N"] == 2), None)
    if two:
        bw = [
            f"{nb / 2**20:g} MB {nb / two[k] / 1e9:.2f} GB/s"
            for k, nb in (("1MB", 2**20), ("16MB", 16 * 2**20))
            if k in two
        ]
        print(
            f"  alpha-beta at N=2 (not oversubscribed): latency (8 B allreduce) {two['8B'] * 1e6:.1f} us; "
            f"algbw {', '.join(bw)}; MPI_Init {two['init_s'] * 1e3:.0f} ms, formation "
            f"{two['form_s'] * 1e3:.0f} ms (one merge round and the closing agreement)"
        )


def print_b(rows: list[dict[str, Any]]) -> None:
    print(
        "\n(b) driver CPU per chunk (time.process_time of the driver process, all threads) "
        "with workers that answer at once"
    )
    print(
        f"{'W':>4} | {'k steps':>7} | {'chunks':>6} | {'CPU ms/chunk':>12} | {'CPU ms/step':>11} | "
        f"{'wall ms/chunk':>13} | {'CPU/wall':>8} | {'submit':>6} | {'gather':>6}"
    )
    for r in rows:
        print(
            f"{r['W']:>4} | {r['k']:>7} | {r['chunks']:>6} | {r['cpu_chunk_ms']:12.2f} | {r['cpu_step_ms']:11.3f} | "
            f"{r['wall_chunk_ms']:13.2f} | {r['cpu_share']:8.2f} | {r['submit']:6.0%} | {r['gather']:6.0%}"
        )
    print("  submit: shards, pickling and one run.remote per rank; gather: WorkerGroup.gather (waits, checks, ray.get)")
    # cpu per chunk ~ c0 + c1 W + c2 W k: least squares over the rows
    a = np.array([[1.0, r["W"], r["W"] * r["k"]] for r in rows])
    y = np.array([r["cpu_chunk_ms"] for r in rows])
    if len(rows) >= 3 and np.linalg.matrix_rank(a) == 3:
        c0, c1, c2 = np.linalg.lstsq(a, y, rcond=None)[0]
        print(
            f"  fit: CPU ms/chunk ~ {c0:.2f} + {c1 * 1e3:.0f} us x W + {c2 * 1e3:.1f} us x W x k "
            f"(per chunk, per rank per chunk, per rank per step)"
        )


def pickling(world: int) -> None:
    """Where a rank's step goes in ``submit``: the Sampler's shard and pickling it (torch tensor, or the same as
    numpy)."""
    import ray.cloudpickle as pickle

    sampler = Sampler(0, BATCH, BATCH * 200, range(world, world + 1))
    sampler.shards(0, world)
    start = time.process_time()
    parts = [sampler.shards(s, world) for s in range(100)]
    shard_us = (time.process_time() - start) / (100 * world) * 1e6
    part = parts[0][0]
    cost = {}
    for name, value in (("torch", part), ("numpy", part.numpy())):
        start = time.process_time()
        for _ in range(2000):
            pickle.dumps([(0, value)])
        cost[name] = ((time.process_time() - start) / 2000 * 1e6, len(pickle.dumps([(0, value)])))
    print(
        f"  per rank per step at W={world}: Sampler shard {shard_us:.1f} us; pickling its (epoch, indices) "
        f"{cost['torch'][0]:.0f} us / {cost['torch'][1]} B as a torch tensor, "
        f"{cost['numpy'][0]:.0f} us / {cost['numpy'][1]} B as numpy"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["a", "b", "ab"], default="ab")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 8, 16, 32, 64], help="(a) ranks")
    parser.add_argument("--sizes-16mb", type=int, nargs="+", default=[2, 8, 16], help="(a) ranks that also sum 16 MB")
    parser.add_argument("--reps", type=int, default=20, help="(a) allreduces per size (16 MB: a quarter)")
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 32, 128], help="(b) workers")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 16], help="(b) steps per chunk")
    parser.add_argument("--steps", type=int, default=192, help="(b) steps per measured run")
    parser.add_argument("--quick", action="store_true", help="(a) N=2,4, 3 reps; (b) W=4, k=1,4, 16 steps")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.sizes_16mb, args.reps = [2, 4], [2], 3
        args.workers, args.chunks, args.steps = [4], [1, 4], 16
    cores = len(os.sched_getaffinity(0))
    start_local_ray(2, env=OMP1)
    try:
        rows_a = part_a(args.sizes, set(args.sizes_16mb), args.reps) if "a" in args.part else []
        rows_b = part_b(args.workers, args.chunks, args.steps) if "b" in args.part else []
    finally:
        ray.shutdown()
    if rows_a:
        print_a(rows_a, cores)
    if rows_b:
        print_b(rows_b)
        pickling(max(args.workers))


if __name__ == "__main__":
    main()
