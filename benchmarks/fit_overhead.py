"""What the driver costs: ``raympi.fit`` against the same workers stepping with no driver in the loop.

Three ways to run the same steps on the same 2 worker actors (built by raympi's own ``WorkerGroup``, so the
processes, data and step are identical), interleaved run by run:

    workers only   one ``Worker.run`` call per rank carrying every timed step: no driver in the loop at all
    fit            ``raympi.fit``: the driver's chunk pipeline, metrics records, progress (checkpoint_every=0)
    fit + ckpt/20  ``raympi.fit`` with ``checkpoint_every=20``: rank 0's state to the driver, written to disk
    fit, kept      ``raympi.fit(keep_workers=True)`` right after another such fit: in the worker processes that
                   one kept (no process started, torch not imported again); the earlier fit is not timed

Steady ms/step: fit's from the driver-observed times of its metrics records, from the end of the first chunk
past the warm-up to the last step; workers-only from the wall time of its single timed call.
Also reported: "launch s", the ``fit()`` call to the end of the first step (Ray already running).

    python benchmarks/fit_overhead.py              # cnn and mlp, 3 runs, 200 steps (20 warm-up)
    python benchmarks/fit_overhead.py --quick      # cnn, 1 run, 25 steps
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import ray  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _common import LR, PER_WORKER, SEED, mlp, mnist_example, start_local_ray, synthetic_mnist  # noqa: E402

import raympi  # noqa: E402
from raympi.driver import data  # noqa: E402
from raympi.driver.config import parse_config  # noqa: E402
from raympi.driver.group import WorkerGroup  # noqa: E402
from raympi.worker import WorkerSpec  # noqa: E402

WORLD = 2


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(SEED)
    if name == "cnn":
        return mnist_example().Net()
    if name == "mlp":
        return mlp()
    raise ValueError(f"unknown model {name!r}")


def _dataset(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = PER_WORKER * WORLD * steps  # one epoch holds every step: chunks are never cut short by an epoch end
    return synthetic_mnist(n, SEED)


def _options(tmp: str, **extra) -> dict:
    return dict(
        epochs=1,
        batch_size=PER_WORKER * WORLD,
        optimizer=raympi.optim.sgd(LR),
        progress=False,
        seed=SEED,
        torch_threads=1,
        checkpoint_dir=tempfile.mkdtemp(dir=tmp),
        **extra,
    )


def workers_only(name: str, steps: int, warmup: int, tmp: str) -> dict:
    """The workers of fit, driven by one call per rank for all timed steps."""
    x, y = _dataset(steps)
    cfg = parse_config(workers=WORLD, **_options(tmp, checkpoint_every=0))
    refs = (ray.put(x.numpy()), ray.put(y.numpy()))
    spec = WorkerSpec(
        model=_model(name),
        loss_fn=F.cross_entropy,
        optimizer=cfg.optimizer,
        train=refs,
        device="cpu",
        torch_threads=cfg.torch_threads or max(1, int(cfg.resources_per_worker.get("CPU", 1))),
    )
    group = WorkerGroup(cfg, WORLD, spec, None).start()
    try:
        sampler = data.Sampler(SEED, cfg.batch_size, len(x), WORLD)
        spe = sampler.steps_per_epoch
        shards = [[(s // spe, sampler.shards(s, WORLD)[r]) for s in range(steps)] for r in range(WORLD)]
        ray.get([a.run.remote(shards[r][:warmup], cfg.batch_size) for r, a in enumerate(group.actors)])
        start = time.perf_counter()
        ray.get([a.run.remote(shards[r][warmup:], cfg.batch_size) for r, a in enumerate(group.actors)])
        return {"ms": 1000 * (time.perf_counter() - start) / (steps - warmup)}
    finally:
        group.shutdown()


def run_fit(name: str, steps: int, warmup: int, tmp: str, checkpoint_every: int, kept: bool = False) -> dict:
    x, y = _dataset(steps)
    options = _options(tmp, checkpoint_every=checkpoint_every, keep_workers=kept)
    if kept:  # the fit whose workers this one takes
        raympi.fit(_model(name), (x, y), workers=WORLD, **options)
    start = time.time()
    result = raympi.fit(_model(name), (x, y), workers=WORLD, **options)
    raympi.release_workers()
    times = {r["step"]: r["time"] for r in result.metrics}
    # All records of one chunk carry its end time: time from the end of the chunk holding step `warmup`.
    t0 = times[warmup]
    s0 = max(s for s, t in times.items() if t == t0)
    return {"ms": 1000 * (times[steps] - t0) / (steps - s0), "launch_s": times[1] - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--models", default="cnn,mlp")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.runs, args.steps, args.warmup, args.models = 1, 25, 5, "cnn"
    torch.set_num_threads(1)
    start_local_ray(WORLD, log_to_driver=False)
    modes = {
        "workers only": lambda n, t: workers_only(n, args.steps, args.warmup, t),
        "fit": lambda n, t: run_fit(n, args.steps, args.warmup, t, 0),
        "fit + ckpt/20": lambda n, t: run_fit(n, args.steps, args.warmup, t, 20),
        "fit, kept": lambda n, t: run_fit(n, args.steps, args.warmup, t, 0, kept=True),
    }
    rows: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for name in args.models.split(","):
                for mode, fn in modes.items():
                    r = fn(name, tmp)
                    rows.setdefault((name, mode), []).append(r)
                    print(f"# run {run} {name} {mode}: {r['ms']:.2f} ms/step", flush=True)
    ray.shutdown()
    print(
        f"\nms/step at {WORLD} workers, batch {PER_WORKER}/worker, SGD; {args.runs} run(s) interleaved; "
        f"ratio = median / workers-only median"
    )
    print(f"{'model':<6}| {'mode':<14}| {'min':>7} | {'median':>7} | {'max':>7} | {'ratio':>6} | {'launch s':>8}")
    for name in args.models.split(","):
        base = statistics.median(r["ms"] for r in rows[(name, "workers only")])
        for mode in modes:
            ms = [r["ms"] for r in rows[(name, mode)]]
            launch = [r["launch_s"] for r in rows[(name, mode)] if "launch_s" in r]
            launch_s = f"{statistics.median(launch):8.2f}" if launch else f"{'':8}"
            print(
                f"{name:<6}| {mode:<14}| {min(ms):7.2f} | {statistics.median(ms):7.2f} | {max(ms):7.2f} | "
                f"{statistics.median(ms) / base:6.3f} | {launch_s}"
            )


if __name__ == "__main__":
    main()
