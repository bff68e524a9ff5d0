"""What 16-bit gradients on the wire buy: raympi's allreduce of the 5.8M-parameter MLP's gradients (23.3 MB).

Two ranks (Ray actors, one MPI communicator), ``Communicator.allreduce_`` of one float32 tensor per
MLP parameter, as the step calls it, with ``compression`` None / "bf16" / "fp16", interleaved.  Done
once over MPICH's UCX network module (raympi's choice on one host) and once over OFI/tcp (its choice
across hosts, where the wire is the bottleneck).  Also the error of the summed gradient against float64.

    python benchmarks/compression.py            # 20 reps per mode
    python benchmarks/compression.py --quick    # 3 reps, OFI only

The accuracy side: ``python examples/mnist.py --compression bf16`` against ``python examples/mnist.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
import torch

from raympi import comm

from _common import start_local_ray

SHAPES = [(2048, 784), (2048,), (2048, 2048), (2048,), (10, 2048), (10,)]  # the MLP 784-2048-2048-10


@ray.remote(num_cpus=0)
class Bench(comm.Member):
    def run(self, compression: str | None, reps: int) -> dict:
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(self.comm.rank)
        grads = [torch.randn(s, generator=g) * 1e-3 for s in SHAPES]
        exact = [t.double() for t in grads]
        self.comm.allreduce_(exact)
        plain = self.comm
        self.comm = comm.Communicator(plain.mpi, plain.bucket_bytes, compression)
        times = []
        try:
            for _ in range(reps + 1):  # the first is a warm-up
                work = [t.clone() for t in grads]
                self.comm.barrier()
                start = time.perf_counter()
                self.comm.allreduce_(work)
                times.append(time.perf_counter() - start)
        finally:
            if self.comm._wire_op is not None:
                self.comm._wire_op.Free()
            self.comm = plain
        err = max(((w.double() - e).abs().max() / e.abs().max()).item() for w, e in zip(work, exact))
        return {"times": times[1:], "err": err}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    netmods = ["ofi"] if args.quick else ["ucx", "ofi"]
    reps = 3 if args.quick else args.reps
    start_local_ray(2, log_to_driver=False)
    rows = []
    for netmod in netmods:
        env = {
            "OMP_NUM_THREADS": "1",
            "MPIR_CVAR_CH4_NETMOD": netmod,
            **({"FI_PROVIDER": "tcp"} if netmod == "ofi" else {}),
        }
        actors = [Bench.options(runtime_env={"env_vars": env}).remote() for _ in range(2)]
        comm.form(actors, timeout_s=120)
        results: dict = {}
        for _ in range(3):  # interleaved rounds
            for mode in (None, "bf16", "fp16"):
                per_rank = ray.get([a.run.remote(mode, reps) for a in actors])
                results.setdefault(mode, {"times": [], "err": 0.0})
                results[mode]["times"] += [max(r) for r in zip(*(p["times"] for p in per_rank))]
                results[mode]["err"] = max(results[mode]["err"], *(p["err"] for p in per_rank))
        base = statistics.median(results[None]["times"])
        for mode, r in results.items():
            ms = statistics.median(r["times"]) * 1e3
            rows.append((netmod, mode or "fp32", ms, base * 1e3 / ms, r["err"]))
        for a in actors:
            ray.kill(a)
    ray.shutdown()
    nbytes = sum(torch.Size(s).numel() for s in SHAPES) * 4
    print(f"\nallreduce of {nbytes / 1e6:.1f} MB of float32 gradients, 2 ranks, median of {3 * reps}")
    print(f"{'netmod':<7}| {'wire':<5}| {'ms':>7} | {'speed-up':>8} | {'max rel. error':>14}")
    for netmod, mode, ms, speedup, err in rows:
        print(f"{netmod:<7}| {mode:<5}| {ms:7.2f} | {speedup:7.2f}x | {err:14.2e}")


if __name__ == "__main__":
    main()
