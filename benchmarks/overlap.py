"""Does overlapping the allreduce with computation pay on this machine?  The measurement behind raympi's answer (no).

Two ranks (Ray actors, one MPI communicator, UCX).  "compute" stands for the rest of a backward pass: the
MLP's first-layer weight gradient (32x2048 by 32x784), six times.  "allreduce" is the MLP's 16.8 MB
second-layer gradient.  Four ways, interleaved, median ms of rank 0:

    compute only / allreduce only    each alone
    sequential                       compute, then allreduce (what raympi's step does)
    overlapped                       MPI_Iallreduce started first, computing while it is in flight, then wait

Run once as is and once with MPICH's progress thread (``--async-progress``, MPIR_CVAR_ASYNC_PROGRESS=1),
without which a nonblocking collective only advances inside MPI calls.

    python benchmarks/overlap.py [--async-progress] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
import torch

from raympi import comm

MODES = ("compute only", "allreduce only", "sequential", "overlapped")


@ray.remote(num_cpus=1)
class Rank(comm.Member):
    def run(self, reps: int, rounds: int) -> dict[str, float]:
        torch.set_num_threads(1)
        MPI, mpi = self.comm._MPI, self.comm.mpi
        grad = torch.ones(2048 * 2048)
        a, b = torch.randn(32, 784), torch.randn(32, 2048)
        out: dict[str, list[float]] = {}
        for _ in range(rounds):
            for mode in MODES:
                times = []
                for _ in range(reps):
                    mpi.Barrier()
                    start = time.perf_counter()
                    if mode == "overlapped":
                        request = mpi.Iallreduce(MPI.IN_PLACE, grad.numpy(), op=MPI.SUM)
                        for _ in range(6):
                            b.t() @ a
                            request.Test()  # give MPI a chance to progress between pieces of work
                        self.comm._wait(request, grad)
                    else:
                        if mode != "allreduce only":
                            for _ in range(6):
                                b.t() @ a
                        if mode != "compute only":
                            self.comm._reduce_flat(grad)
                    times.append(time.perf_counter() - start)
                out.setdefault(mode, []).append(statistics.median(times) * 1e3)
        return {mode: statistics.median(v) for mode, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--async-progress", action="store_true", help="MPIR_CVAR_ASYNC_PROGRESS=1 in the ranks")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    env = {"OMP_NUM_THREADS": "1", "MPIR_CVAR_CH4_NETMOD": "ucx"}
    if args.async_progress:
        env["MPIR_CVAR_ASYNC_PROGRESS"] = "1"
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": env})
    ranks = [Rank.remote() for _ in range(2)]
    comm.form(ranks, timeout_s=120)
    result = ray.get([r.run.remote(3 if args.quick else 15, 1 if args.quick else 3) for r in ranks])[0]
    ray.shutdown()
    print(f"\n2 ranks, UCX, async progress {'on' if args.async_progress else 'off'}: median ms (rank 0)")
    for mode in MODES:
        print(f"{mode:<16} {result[mode]:8.2f}")
    print(f"overlapped / sequential: {result['overlapped'] / result['sequential']:.2f}")


if __name__ == "__main__":
    main()
