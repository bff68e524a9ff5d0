"""Does overlapping the allreduce with computation pay on this machine?  The measurements behind ``overlap``'s default.

``--step`` (the real option): two ranks run raympi's ``train_step`` (``donate=True``, SGD, as the
workers do) three ways, interleaved in rounds with a rotating first: ``overlap=False`` (one bucketed
allreduce after backward), ``overlap=True`` inline (each bucket's ``MPI_Iallreduce`` started from its
backward hook, tested at each later hook) and ``overlap=True`` on the reduction thread (what CUDA
uses).  Median ms per step of rank 0 for the 5.8M MLP and the CNN of examples/mnist.py, with
``--threads`` torch threads per rank (default 2):

    python benchmarks/overlap.py --step [--threads 2] [--bucket-mb 16] [--rounds 8] [--quick]

Without ``--step``, the micro-benchmark that came first.  Two ranks (Ray actors, one MPI communicator,
UCX).  "compute" stands for the rest of a backward pass: the MLP's first-layer weight gradient
(32x2048 by 32x784), six times.  "allreduce" is the MLP's 16.8 MB second-layer gradient.  Four ways,
interleaved, median ms of rank 0:

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
import torch.nn.functional as F
from torch import nn

import raympi
from raympi import comm
from raympi.comm.buckets import BucketAllreduce
from raympi.core.state import TrainState
from raympi.core.step import make_train_step

from _common import mlp, mnist_example, start_local_ray

STEP_MODES = ("overlap=False", "overlap inline", "overlap thread")

MODES = ("compute only", "allreduce only", "sequential", "overlapped")


@ray.remote(num_cpus=1)
class Rank(comm.Member):
    def run(self, reps: int, rounds: int) -> dict[str, float]:
        torch.set_num_threads(1)
        MPI, mpi = self.comm.MPI, self.comm.mpi
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
                        self.comm.wait(request, grad)
                    else:
                        if mode != "allreduce only":
                            for _ in range(6):
                                b.t() @ a
                        if mode != "compute only":
                            self.comm.allreduce_array_(grad.numpy())
                    times.append(time.perf_counter() - start)
                out.setdefault(mode, []).append(statistics.median(times) * 1e3)
        return {mode: statistics.median(v) for mode, v in out.items()}

    def steps(
        self, model_name: str, threads: int, bucket_bytes: int, batch: int, steps: int, rounds: int
    ) -> dict[str, float]:
        """ms per train_step of each of STEP_MODES, interleaved; also checks they end with equal parameters."""
        torch.set_num_threads(threads)
        self.comm.bucket_bytes = bucket_bytes
        opt = raympi.optim.sgd(0.01, momentum=0.9)
        model = _models()[model_name]()
        syncs = {
            "overlap=False": self.comm.allreduce_,
            "overlap inline": BucketAllreduce(self.comm, thread=False),
            "overlap thread": BucketAllreduce(self.comm, thread=True),
        }
        fns = {
            m: make_train_step(
                model,
                F.cross_entropy,
                opt,
                grad_sync=syncs[m],
                rank=self.comm.rank,
                donate=True,
                overlap=m != "overlap=False",
            )
            for m in STEP_MODES
        }
        fresh = TrainState.create(model, opt)
        states = {
            m: raympi.core.pytree.map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, fresh)
            for m in STEP_MODES
        }
        g = torch.Generator().manual_seed(self.comm.rank)
        shape = (3, 32, 32) if model_name.startswith("resnet") else (1, 28, 28)
        data = [
            (torch.randn(batch, *shape, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(4)
        ]
        times: dict[str, list[float]] = {m: [] for m in STEP_MODES}
        for r in range(rounds + 1):  # round 0 warms up
            order = STEP_MODES[r % 3 :] + STEP_MODES[: r % 3]
            for mode in order:
                per = []
                for i in range(steps):
                    self.comm.barrier()
                    start = time.perf_counter()
                    states[mode], _ = fns[mode](states[mode], data[i % 4], batch * self.comm.size)
                    per.append(time.perf_counter() - start)
                if r:
                    times[mode].append(statistics.median(per) * 1e3)
        ref = states["overlap=False"].params
        diff = max((states[m].params[k] - ref[k]).abs().max().item() for m in STEP_MODES for k in ref)
        return {**{m: statistics.median(v) for m, v in times.items()}, "max |param diff|": diff}


def _models() -> dict:
    def resnet18() -> nn.Module:
        import torchvision

        return torchvision.models.resnet18(num_classes=10)

    return {
        "mlp 784-2048-2048-10 (5.8M)": mlp,
        "cnn examples/mnist.py (108k)": mnist_example().Net,
        "resnet18 3x32x32 (11.2M)": resnet18,
    }


def _step_table(ranks: list, args: argparse.Namespace) -> None:
    steps, rounds = (3, 2) if args.quick else (5, args.rounds)
    print(
        f"\n2 ranks, UCX, {args.threads} torch thread(s) each, batch {args.batch} per rank, "
        f"bucket {args.bucket_mb} MiB, median ms/step of rank 0 ({rounds} rounds x {steps} steps, interleaved)"
    )
    print(
        f"{'model':<30} | "
        + " | ".join(f"{m:>14}" for m in STEP_MODES)
        + " | inline/off | thread/off | max |param diff|"
    )
    for name in _models():
        if args.models and not any(name.startswith(m) for m in args.models.split(",")):
            continue
        res = ray.get(
            [r.steps.remote(name, args.threads, int(args.bucket_mb * 2**20), args.batch, steps, rounds) for r in ranks]
        )[0]
        off = res["overlap=False"]
        print(
            f"{name:<30} | "
            + " | ".join(f"{res[m]:>14.2f}" for m in STEP_MODES)
            + f" | {res['overlap inline'] / off:>10.2f} | {res['overlap thread'] / off:>10.2f} | "
            f"{res['max |param diff|']:.1e}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--async-progress", action="store_true", help="MPIR_CVAR_ASYNC_PROGRESS=1 in the ranks")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--step", action="store_true", help="time the real train_step with overlap off / inline / thread"
    )
    parser.add_argument("--threads", type=int, default=2, help="--step: torch threads per rank")
    parser.add_argument("--bucket-mb", type=float, default=16, help="--step: bucket_bytes in MiB")
    parser.add_argument("--rounds", type=int, default=8, help="--step: interleaved rounds of 5 steps per mode")
    parser.add_argument("--batch", type=int, default=32, help="--step: samples per rank")
    parser.add_argument(
        "--models", default="", help="--step: comma-separated name prefixes (mlp, cnn, resnet18); default all"
    )
    args = parser.parse_args()
    env = {"OMP_NUM_THREADS": "1", "MPIR_CVAR_CH4_NETMOD": "ucx"}
    if args.async_progress:
        env["MPIR_CVAR_ASYNC_PROGRESS"] = "1"
    start_local_ray(2, env=env, log_to_driver=False)
    ranks = [Rank.remote() for _ in range(2)]
    comm.form(ranks, timeout_s=120)
    if args.step:
        _step_table(ranks, args)
        ray.shutdown()
        return
    result = ray.get([r.run.remote(3 if args.quick else 15, 1 if args.quick else 3) for r in ranks])[0]
    ray.shutdown()
    print(f"\n2 ranks, UCX, async progress {'on' if args.async_progress else 'off'}: median ms (rank 0)")
    for mode in MODES:
        print(f"{mode:<16} {result[mode]:8.2f}")
    print(f"overlapped / sequential: {result['overlapped'] / result['sequential']:.2f}")


if __name__ == "__main__":
    main()
