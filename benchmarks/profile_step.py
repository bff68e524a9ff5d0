"""Where the milliseconds of one raympi step go, at 2 ranks on this machine.

Two real worker ranks (Ray actors, one MPI communicator), one torch thread each, the step that
``raympi.fit`` runs (``make_train_step(..., grad_sync=comm.allreduce_, donate=True)``), SGD,
32 samples per rank.  Phases, each the median over the timed steps on rank 0:

    forward           torch.func.functional_call and the loss, building the autograd graph (timed alone)
    backward          torch.autograd.grad through it (forward+backward timed alone, minus forward)
    allreduce         grad_sync: the MPI sum of the gradient tree and the metrics vector
    raw allreduce     one MPI_Allreduce of a buffer as large as all gradients (the floor)
    optimizer+rest    the whole step minus forward, backward and allreduce (update, metrics, dropout seeding)
    step              the whole train_step

The driver's share (fit against the same workers with no driver in the loop) is benchmarks/fit_overhead.py's.

    python benchmarks/profile_step.py            # CNN of examples/mnist.py and the 5.8M MLP
    python benchmarks/profile_step.py --quick
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

from _common import mlp, mnist_example, start_local_ray


def models() -> dict:
    return {"cnn (examples/mnist.py)": mnist_example().Net, "mlp 784-2048-2048-10": mlp}


@ray.remote(num_cpus=1)
class Profiler(comm.Member):
    def profile(self, make_model, steps: int, batch: int) -> dict:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = make_model()
        opt = raympi.optim.sgd(0.01)
        sync_times = []

        def timed_sync(tree):
            start = time.perf_counter()
            self.comm.allreduce_(tree)
            sync_times.append(time.perf_counter() - start)

        step = make_train_step(model, F.cross_entropy, opt, grad_sync=timed_sync, rank=self.comm.rank, donate=True)
        state = TrainState.create(model, opt)
        state = raympi.core.pytree.map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state)
        x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
        step_times, fb_times, raw_times, fwd_times = [], [], [], []

        def forward(params):  # the step's forward, building the autograd graph as the step does
            leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
            return F.cross_entropy(torch.func.functional_call(model, (leaves, state.buffers), (x,)), y), leaves

        def grad_fn(params):  # the step's gradient: autograd.grad on detached leaves, as raympi.core.step does
            loss, leaves = forward(params)
            return torch.autograd.grad(loss, list(leaves.values()))

        flat = torch.zeros(sum(p.numel() for p in state.params.values()))
        for i in range(steps + 3):
            self.comm.barrier()
            start = time.perf_counter()
            state, _ = step(state, (x, y), batch * self.comm.size)
            step_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            grad_fn(state.params)
            fb_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            forward(state.params)
            fwd_times.append(time.perf_counter() - start)
            self.comm.barrier()
            start = time.perf_counter()
            self.comm.allreduce_array_(flat.numpy())
            raw_times.append(time.perf_counter() - start)
        med = lambda xs: statistics.median(xs[3:]) * 1e3  # noqa: E731  first 3 are warm-up
        return {
            "step": med(step_times),
            "fwd_bwd": med(fb_times),
            "fwd": med(fwd_times),
            "allreduce": med(sync_times),
            "raw": med(raw_times),
            "params": flat.numel(),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    steps = 3 if args.quick else args.steps
    start_local_ray(
        2,
        env={
            "OMP_NUM_THREADS": "1",
            "MALLOC_MMAP_THRESHOLD_": str(64 * 2**20),
            "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1),
        },
    )
    actors = [Profiler.remote() for _ in range(2)]
    comm.form(actors, timeout_s=60)
    print(
        f"\n{'model':<24} {'params':>9} {'step':>8} {'forward':>8} {'backward':>8} {'allreduce':>10} {'raw MPI':>8} "
        f"{'optim+rest':>10}  (ms, rank 0, 2 ranks)"
    )
    for name, make in list(models().items())[: 1 if args.quick else None]:
        r = ray.get([a.profile.remote(make, steps, 32) for a in actors])[0]
        rest = r["step"] - r["fwd_bwd"] - r["allreduce"]
        print(
            f"{name:<24} {r['params']:>9,} {r['step']:8.2f} {r['fwd']:8.2f} {r['fwd_bwd'] - r['fwd']:8.2f} "
            f"{r['allreduce']:10.2f} {r['raw']:8.2f} {rest:10.2f}"
        )
    ray.shutdown()


if __name__ == "__main__":
    main()
