"""What the functional step costs: ``train_step`` against the plain PyTorch loop.

One process, no communicator.  For each model and optimizer the three loops
run side by side on the same synthetic MNIST-shaped batches, interleaved in
rounds (rotating which goes first) so drifts in machine speed hit all three;
the table reports the median time per step of each and the ratios to plain.

    plain:       opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()
    train_step:  state, metrics = train_step(state, (x, y))      # pure
    donate=True: the same, built with make_train_step(..., donate=True)

The functional step also returns metrics (one host read) and seeds dropout
per step; the plain loop reads nothing back, so the ratio is conservative.

Run:
    python benchmarks/step_overhead.py            # full: about a minute on 2 cores
    python benchmarks/step_overhead.py --quick    # seconds, for tests
    python benchmarks/step_overhead.py --malloc tuned   # without glibc's page-fault noise
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raympi.core import optim  # noqa: E402
from raympi.core.state import TrainState  # noqa: E402
from raympi.core.step import make_train_step  # noqa: E402


def mnist_cnn() -> nn.Module:
    """The classic PyTorch MNIST example network (1.2M parameters)."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(),
        nn.Conv2d(32, 64, 3), nn.ReLU(),
        nn.MaxPool2d(2), nn.Dropout(0.25), nn.Flatten(),
        nn.Linear(9216, 128), nn.ReLU(), nn.Dropout(0.5),
        nn.Linear(128, 10),
    )  # fmt: skip


def mlp_5m() -> nn.Module:
    """784-2048-2048-10 (5.8M parameters)."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)
    )


MODELS: dict[str, Callable[[], nn.Module]] = {"mnist_cnn": mnist_cnn, "mlp_784-2048-2048-10": mlp_5m}
OPTIMIZERS = {
    "sgd_m0.9": (lambda: optim.sgd(0.01, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9)),
    "adam": (lambda: optim.adam(1e-3), lambda p: torch.optim.Adam(p, lr=1e-3)),
}


def _tune_malloc() -> str:
    """Keep freed memory in glibc's heap instead of handing it back to the kernel.

    By default glibc returns large freed blocks to the kernel (munmap, heap
    trimming) and the next allocation page-faults them back in, a few
    thousand faults a step here.  Whether a loop hits that depends on the
    heap's history, which made runs differ by 10% at random.  Tuned, the
    allocator keeps blocks (<= 32 MiB) for reuse.  Same effect as the
    environment variables MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 32 * 2**20) and libc.mallopt(m_trim_threshold, 2**31 - 1)
    except (OSError, AttributeError):
        ok = False
    return "tuned (mallopt)" if ok else "default (mallopt unavailable)"


def _measure(model_name: str, opt_name: str, batch: int, rounds: int, steps: int, clock) -> dict:
    torch.manual_seed(0)
    model = MODELS[model_name]()
    ref = MODELS[model_name]()
    ref.load_state_dict(model.state_dict())
    ref.train()
    ours, theirs = OPTIMIZERS[opt_name]
    opt = ours()
    states = {"pure": TrainState.create(model, opt), "donated": TrainState.create(model, opt)}
    step_fns = {
        "pure": make_train_step(model, F.cross_entropy, opt),
        "donated": make_train_step(model, F.cross_entropy, opt, donate=True),
    }
    ref_opt = theirs(ref.parameters())
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(4)]

    def plain(i: int) -> None:
        x, y = data[i % len(data)]
        ref_opt.zero_grad(set_to_none=True)
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()

    def functional(kind: str) -> Callable[[int], None]:
        def run(i: int) -> None:
            states[kind], _ = step_fns[kind](states[kind], data[i % len(data)])

        return run

    loops = {"plain": plain, "pure": functional("pure"), "donated": functional("donated")}
    times: dict[str, list[float]] = {k: [] for k in loops}
    for i in range(2):  # warm-up: allocator, kernels, lazy optimizer state
        for fn in loops.values():
            fn(i)
    names = list(loops)
    for r in range(rounds):
        for name in names[r % 3 :] + names[: r % 3]:  # rotate who goes first
            t0 = clock()
            for i in range(steps):
                loops[name](i)
            times[name].append((clock() - t0) / steps)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "model": model_name,
        "params": sum(x.numel() for x in model.parameters()),
        "optimizer": opt_name,
        "batch": batch,
        "plain_steps_s": 1 / med["plain"],
        "functional_steps_s": 1 / med["pure"],
        "ratio": med["pure"] / med["plain"],
        "donated_steps_s": 1 / med["donated"],
        "donated_ratio": med["donated"] / med["plain"],
    }


def main(argv: Optional[list[str]] = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny run (seconds), for tests")
    ap.add_argument("--batch", type=int, default=None, help="samples per step (default 64, quick 4)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 30, quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="steps per round and loop (default 2, quick 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument(
        "--malloc", choices=["default", "tuned"], default="default",
        help="tuned: keep freed memory in the heap (glibc mallopt), no page faults from reuse",
    )  # fmt: skip
    ap.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall",
        help="wall: time.perf_counter; cpu: this thread's CPU time, steadier on a busy machine (threads=1)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    batch = args.batch or (4 if args.quick else 64)
    rounds = args.rounds or (1 if args.quick else 30)
    steps = args.steps or (1 if args.quick else 2)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    torch.set_num_threads(args.threads)
    malloc = _tune_malloc() if args.malloc == "tuned" else "default"

    print(f"torch {torch.__version__}, {args.threads} thread(s), batch {batch}, "
          f"{rounds} rounds x {steps} steps, {args.clock} clock, malloc {malloc}, medians")  # fmt: skip
    header = (
        f"{'model':<22} {'params':>9} {'optim':<8} {'plain st/s':>10} "
        f"{'train_step st/s':>15} {'ratio':>6} {'donate=True st/s':>16} {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for model_name in MODELS:
        for opt_name in OPTIMIZERS:
            row = _measure(model_name, opt_name, batch, rounds, steps, clock)
            rows.append(row)
            print(
                f"{row['model']:<22} {row['params']:>9,} {row['optimizer']:<8} {row['plain_steps_s']:>10.2f} "
                f"{row['functional_steps_s']:>15.2f} {row['ratio']:>6.3f} "
                f"{row['donated_steps_s']:>16.2f} {row['donated_ratio']:>6.3f}",
                flush=True,
            )
    print("ratio = time per step / plain PyTorch's time per step (1.10 = 10% slower)")
    return rows


if __name__ == "__main__":
    main()
