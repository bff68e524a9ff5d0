"""Formation time and allreduce speed: raympi's MPI communicator next to torch.distributed (gloo).

Both run in the same Ray actors in the same invocation, interleaved per size, so the
two columns see the same machine load.

    python benchmarks/comm_bench.py               # N = 2, 4, 8; 1, 16, 64 MB
    python benchmarks/comm_bench.py --quick       # N = 2; 1 MB (a smoke run)
    python benchmarks/comm_bench.py --buckets     # N = 2: the MLP's 23.3 MB of gradients per bucket_bytes
"""

from __future__ import annotations

import argparse
import socket
import time

import ray
import torch

from raympi import comm

from _common import OMP1, slowest_median, start_local_ray, time_reps


@ray.remote(num_cpus=0)
class Bench(comm.Member):
    def gloo_init(self, rank: int, size: int, addr: str) -> float:
        import torch.distributed as dist

        start = time.perf_counter()
        dist.init_process_group("gloo", init_method=addr, rank=rank, world_size=size)
        return time.perf_counter() - start

    def gloo_shutdown(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()

    def time_allreduce(self, nbytes: int, reps: int, which: str) -> list[float]:
        import torch.distributed as dist

        x = torch.ones(nbytes // 4, dtype=torch.float32)
        reduce = (lambda: self.comm.allreduce_([x])) if which == "mpi" else (lambda: dist.all_reduce(x))
        return time_reps(self.comm.barrier, reduce, reps)  # after a warm-up

    def time_buckets(self, bucket_mib: list[float], reps: int) -> dict[float, list[float]]:
        """allreduce_ of the MLP 784-2048-2048-10's gradient shapes, per bucket size."""
        grads = [torch.ones(s) for s in ((2048, 784), (2048,), (2048, 2048), (2048,), (10, 2048), (10,))]
        out: dict[float, list[float]] = {}
        for _ in range(3):  # interleaved rounds
            for mib in bucket_mib:
                self.comm.bucket_bytes = int(mib * 2**20)
                for _ in range(reps):
                    self.comm.barrier()
                    start = time.perf_counter()
                    self.comm.allreduce_(grads)
                    out.setdefault(mib, []).append(time.perf_counter() - start)
        return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bucket_sweep(reps: int) -> None:
    start_local_ray(2, env=OMP1)
    actors = [Bench.remote() for _ in range(2)]
    comm.form(actors, timeout_s=120)
    sizes = [0.25, 1, 4, 16, 64]
    per_rank = ray.get([a.time_buckets.remote(sizes, reps) for a in actors])
    ray.shutdown()
    print("\nbucket_bytes sweep: allreduce_ of 23.3 MB (the MLP's gradients), 2 ranks, median ms (max over ranks)")
    for mib in sizes:
        print(f"{mib:>8g} MiB {slowest_median([r[mib] for r in per_rank]) * 1e3:8.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--mb", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="N=2, 1 MB, 2 reps")
    parser.add_argument("--buckets", action="store_true", help="only the bucket_bytes sweep, N=2")
    args = parser.parse_args()
    if args.buckets:
        return bucket_sweep(args.reps)
    if args.quick:
        args.sizes, args.mb, args.reps = [2], [1], 2
    start_local_ray(max(args.sizes), env=OMP1)
    rows = []
    for n in args.sizes:
        actors = [Bench.remote() for _ in range(n)]
        ray.get([a.__ray_ready__.remote() for a in actors])
        start = time.perf_counter()
        comm.form(actors, timeout_s=120, bucket_bytes=64 * 2**20)
        mpi_form = time.perf_counter() - start
        addr = f"tcp://127.0.0.1:{_free_port()}"
        gloo_form = max(ray.get([a.gloo_init.remote(r, n, addr) for r, a in enumerate(actors)]))
        rows.append((n, "formation", mpi_form, gloo_form, None, None))
        for mb in args.mb:
            nbytes = mb * 2**20
            result = {}
            for which in ("mpi", "gloo"):
                per_rank = ray.get([a.time_allreduce.remote(nbytes, args.reps, which) for a in actors])
                result[which] = slowest_median(per_rank)
            rows.append(
                (
                    n,
                    f"allreduce {mb} MB",
                    result["mpi"],
                    result["gloo"],
                    nbytes / result["mpi"],
                    nbytes / result["gloo"],
                )
            )
        ray.get([a.gloo_shutdown.remote() for a in actors])
        for a in actors:
            ray.kill(a)
    print(
        f"\n{'N':>3} {'what':<18} {'raympi (MPI)':>14} {'gloo':>12} {'MPI algbw':>12} {'gloo algbw':>12} "
        f"{'gloo/MPI':>9}"
    )
    for n, what, mpi_s, gloo_s, mpi_bw, gloo_bw in rows:
        bw = f"{mpi_bw / 1e9:10.2f}GB/s {gloo_bw / 1e9:10.2f}GB/s" if mpi_bw else f"{'':>12} {'':>12}"
        print(f"{n:>3} {what:<18} {mpi_s * 1e3:12.1f}ms {gloo_s * 1e3:10.1f}ms {bw} {gloo_s / mpi_s:8.2f}x")
    ray.shutdown()


if __name__ == "__main__":
    main()
