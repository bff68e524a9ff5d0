"""raympi against the usual ways of data-parallel PyTorch training on CPU, same workload, interleaved.

Contenders, each training the same model from the same initial weights on the same global batches
(SGD lr 0.01, no momentum; 32 samples per worker, global batch 32*W; loss = mean over the global
batch; 1 torch thread per process, CPU):

    raympi            raympi.fit on a fresh local Ray (ray.init(address="local", num_cpus=W)), gradients over MPI
    raympi-gloo       the same with grad_transport="gloo": a gloo process group built from the MPI communicator
    torchrun-ddp      python -m torch.distributed.run --standalone --nproc_per_node W, DDP over gloo
    raytrain          Ray Train TorchTrainer (ScalingConfig(num_workers=W)), prepare_model (DDP, gloo),
                      on a fresh local Ray; Train V2 is Ray 2.60's default and is what runs
    mpiexec-template  the classic mpi4py template under the mpich wheel's mpiexec: loss.backward(),
                      then comm.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM) per parameter, / W
    floor             one process, batch 32 (one worker's share), no communication: the compute floor
    raw-allreduce     not a trainer: W Ray actors joined by raympi.comm.form with fit's MPI environment
                      time RAW_REPS allreduces of one float32 buffer as large as all the gradients
                      (the same kind of processes and transport as raympi's workers); its "ms/step" is
                      the median of those reps, with their 10th-90th percentiles beside it

Models: the CNN of examples/mnist.py (``Net``, 108k parameters) and an MLP 784-2048-2048-10 (5.8M).
Data: synthetic MNIST-shaped tensors of a fixed seed, N = 32*W*E samples, so that one epoch is
E = --warmup steps.  Every contender reads raympi's own order (raympi.driver.data.epoch_order(seed, epoch,
N), step i of the epoch is order[i*B:(i+1)*B], split by rank_slices into contiguous parts).  The
short epoch is what gives raympi's driver-side clock a chunk boundary exactly at the end of the
warm-up (raympi ends a chunk of steps at every epoch end); it also caps its chunks at E steps,
smaller than the ~0.5 s chunks it picks on long epochs, which if anything is pessimistic for raympi.

Timing: ms/step in the steady state = wall time of steps warmup+1..steps / (steps - warmup).
The subprocess contenders time it inside rank 0 between two barriers; raympi from the driver-observed
times of its metrics records (step `warmup` to the last step).  "launch s" is the time from the start
of the contender (raympi: the fit() call; Ray Train: trainer.fit(); the others: the subprocess launch)
to the end of rank 0's first step; Ray's own start (ray.init) is not included.

After the table, "raympi vs the targets" sets raympi's median against torchrun-DDP's, the template's, and the
floor plus the raw communication: the raw-allreduce contender's median (interleaved with the others in every
run), and, for reference, one MPI_Allreduce of the same size timed under mpiexec by the template's ranks right
after their run (mpiexec's default transport), each with its spread over the reps.

Correctness: every contender but the floor saves its final parameters; each must agree with raympi's
(or, without raympi, the first one that ran) to atol = rtol = 1e-4 (summation orders differ), else
FAIL and a non-zero exit.

Run:
    python benchmarks/compare.py            # 3 runs x 2 models x W in (2, 4) x 5 contenders, 40 steps (10 warm-up)
                                            # about 20 min on 2 busy cores: launches, not steps, dominate
    python benchmarks/compare.py --models cnn --workers 2 --contenders raympi,torchrun-ddp
    python benchmarks/compare.py --quick    # 1 run, CNN, W=2, 15 steps, raympi + mpiexec + floor

Writes benchmarks/out/compare.csv (every run) and benchmarks/out/compare.png (median ms/step, min-max bars).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from _common import (  # noqa: E402  (benchmarks/_common.py: what the benchmarks share)
    BIN,
    CHILD_TIMEOUT_S,
    LR,
    OUT,
    PER_WORKER,
    SEED,
    add_child_options,
    attempt,
    ddp,
    example_net_class,
    fmt,
    fresh_ray,
    median_or_none,
    min_median_max,
    mlp,
    mnist_example,
    raytrain_ddp,
    read_spec,
    rotated,
    run_spec_child,
    share_one_ray,
    spread,
    synthetic_mnist,
    time_reps,
    torchrun_gloo,
    write_csv,
    write_spec,
)
from _common import run_raytrain as _run_raytrain  # noqa: E402
from _common import run_torchrun as _run_torchrun  # noqa: E402

ATOL = RTOL = 1e-4
RAW_REPS = 60

MODELS = ("cnn", "mlp")
CONTENDERS = ("raympi", "raympi-gloo", "torchrun-ddp", "raytrain", "mpiexec-template", "floor", "raw-allreduce")
COMPARED = ("raympi", "torchrun-ddp", "mpiexec-template", "raytrain")  # order of preference for the reference


# ---------------------------------------------------------------- the workload (driver and children)


def build_model(name: str) -> nn.Module:
    """A fresh model: 'cnn' is examples/mnist.py's Net (its class source, run here without importing raympi; the driver
    imports the example for real and checks that both give the same parameter shapes), 'mlp' the 5.8M MLP."""
    if name == "mlp":
        return mlp()
    if name == "cnn":
        return example_net_class()()
    raise ValueError(f"unknown model {name!r}")


def epoch_order(seed: int, epoch: int, n: int) -> torch.Tensor:
    """raympi.driver.data.epoch_order, restated so that children need not import raympi (the driver checks they
    agree)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def local_indices(step: int, n: int, world: int, rank: int, seed: int = SEED) -> torch.Tensor:
    """This rank's sample indices at global ``step``: raympi's order and split."""
    batch = PER_WORKER * world
    epoch, i = divmod(step, n // batch)
    return torch.tensor_split(epoch_order(seed, epoch, n)[i * batch : (i + 1) * batch], world)[rank]


def _run_loop(
    spec: dict[str, Any],
    rank: int,
    world: int,
    model: nn.Module,
    raw: nn.Module,
    sync: Optional[Callable[[], None]],
    barrier: Callable[[], None],
) -> None:
    """The shared loop: SGD steps on this rank's part of each global batch, timed between barriers; rank 0 writes the
    result.

    ``world`` is the number of ranks of the workload (the floor runs rank 0's part alone with world=W).
    """
    torch.set_num_threads(1)
    data = torch.load(spec["data"], weights_only=True)
    x, y = data["x"], data["y"]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    steps, warmup = spec["steps"], spec["warmup"]
    indices = [local_indices(s, len(x), world, rank) for s in range(steps)]
    first_step_wall = t0 = None
    for s in range(steps):
        if s == warmup:
            barrier()
            t0 = time.perf_counter()
        idx = indices[s]
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        if sync is not None:
            sync()
        opt.step()
        if s == 0:
            first_step_wall = time.time()
    barrier()
    elapsed = time.perf_counter() - t0
    if rank == 0:
        params = {k: v.detach().clone() for k, v in raw.named_parameters()}
        torch.save(params, spec["params"])
        Path(spec["result"]).write_text(
            json.dumps(
                {
                    "ms_per_step": 1000 * elapsed / (steps - warmup),
                    "first_step_wall": first_step_wall,
                    "world": world,
                    "pid": os.getpid(),
                }
            )
        )


def _load_model(spec: dict[str, Any]) -> nn.Module:
    model = build_model(spec["model"])
    model.load_state_dict(torch.load(spec["init"], weights_only=True))
    return model


def _child(mode: str, spec_path: str) -> None:
    """Entry point of the subprocess contenders (this file run with --child)."""
    spec = read_spec(spec_path)
    torch.set_num_threads(1)
    if mode == "ddp":
        with torchrun_gloo() as (rank, world, barrier):
            model = _load_model(spec)
            _run_loop(spec, rank, world, ddp(model), model, None, barrier)
    elif mode == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        world = comm.Get_size()
        model = _load_model(spec)
        params = [p for p in model.parameters() if p.requires_grad]

        def sync() -> None:  # the classic template: one Allreduce per parameter, then the mean
            for p in params:
                comm.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)
                p.grad.div_(world)

        _run_loop(spec, comm.Get_rank(), world, model, model, sync, comm.Barrier)
        # The communication floor: one MPI_Allreduce of a buffer as large as all the gradients.
        flat = torch.zeros(sum(p.numel() for p in params)).numpy()
        times = []
        for _ in range(RAW_REPS + 1):
            comm.Barrier()
            start = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
            times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
        if comm.Get_rank() == 0:
            res = json.loads(Path(spec["result"]).read_text())
            res.update(spread(times[1:], "raw_allreduce_"))
            Path(spec["result"]).write_text(json.dumps(res))
    elif mode == "floor":
        model = _load_model(spec)
        _run_loop(spec, 0, spec["workers"], model, model, None, lambda: None)
    else:
        raise SystemExit(f"unknown child mode {mode!r}")


def _raytrain_loop(spec: dict[str, Any]) -> None:
    """Ray Train's train_loop_per_worker: prepare_model wraps the model in DDP (gloo, set up by TorchTrainer)."""
    torch.set_num_threads(1)
    model = _load_model(spec)
    wrapped, rank, world, barrier = raytrain_ddp(model)
    _run_loop(spec, rank, world, wrapped, model, None, barrier)


# ---------------------------------------------------------------- the contenders, seen from the driver


def _child_result(res: dict[str, Any]) -> dict[str, Any]:
    """What a contender run as a child process (run_spec_child: torchrun / mpiexec and its ranks) reports."""
    return {
        "ms_per_step": res["ms_per_step"],
        "launch_s": res["launch_s"],
        "params": res["params"],
        **{k: v for k, v in res.items() if k.startswith("raw_allreduce_")},
    }


def run_torchrun(spec: dict[str, Any], workers: int) -> dict[str, Any]:
    return _child_result(_run_torchrun(__file__, spec, workers, CHILD_TIMEOUT_S))


def run_mpiexec(spec: dict[str, Any], workers: int) -> dict[str, Any]:
    mpiexec = BIN / "mpiexec" if (BIN / "mpiexec").exists() else shutil.which("mpiexec")
    if not mpiexec:
        raise RuntimeError("no mpiexec next to the interpreter or on PATH (pip install mpich)")
    cmd = [
        str(mpiexec),
        "-n",
        str(workers),
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "mpi",
        "--spec",
        spec["path"],
    ]
    return _child_result(run_spec_child(cmd, spec, CHILD_TIMEOUT_S))


def run_raw_allreduce(spec: dict[str, Any], workers: int) -> dict[str, Any]:
    """RAW_REPS allreduces of a gradient-sized float32 buffer among W Ray actors in fit's MPI environment."""
    import numpy as np
    import ray

    from raympi import comm
    from raympi.driver.config import MPIConfig

    @ray.remote(num_cpus=1)
    class Rank(comm.Member):
        def time_allreduce(self, count: int, reps: int) -> list[float]:
            x = np.zeros(count, dtype=np.float32)
            return time_reps(
                self.comm.barrier, lambda: self.comm.allreduce_array_(x), reps
            )  # the first sets up the connections

    count = sum(p.numel() for p in build_model(spec["model"]).parameters())
    with fresh_ray(workers):
        env = {**MPIConfig().environment(multi_host=False), "OMP_NUM_THREADS": "1"}
        ranks = [Rank.options(runtime_env={"env_vars": env}).remote() for _ in range(workers)]
        comm.form(ranks, timeout_s=120)
        per_rank = ray.get([r.time_allreduce.remote(count, RAW_REPS) for r in ranks], timeout=CHILD_TIMEOUT_S)
    slowest = [max(rep) for rep in zip(*per_rank)]
    res = spread(slowest, "raw_allreduce_")
    return {"ms_per_step": res["raw_allreduce_ms"], "launch_s": None, "params": None, **res}


def run_floor(spec: dict[str, Any], workers: int) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "floor", "--spec", spec["path"]]
    res = _child_result(run_spec_child(cmd, spec, CHILD_TIMEOUT_S))
    res["params"] = None  # batch 32, not the global batch: a different trajectory, not compared
    return res


def run_raympi(spec: dict[str, Any], workers: int, transport: str = "mpi") -> dict[str, Any]:
    import raympi

    torch.set_num_threads(1)
    mnist = mnist_example()
    model = mnist.Net() if spec["model"] == "cnn" else build_model(spec["model"])
    model.load_state_dict(torch.load(spec["init"], weights_only=True))
    data = torch.load(spec["data"], weights_only=True)
    steps, warmup = spec["steps"], spec["warmup"]
    with fresh_ray(workers):
        start = time.time()
        result = raympi.fit(
            model,
            (data["x"], data["y"]),
            workers=workers,
            epochs=-(-steps // warmup),
            max_steps=steps,
            batch_size=PER_WORKER * workers,
            optimizer=raympi.optim.sgd(LR),
            progress=False,
            seed=SEED,
            checkpoint_dir=spec["dir"] + "/raympi-ckpt",
            checkpoint_every=0,
            torch_threads=1,
            grad_transport=transport,
        )
    times = {r["step"]: r["time"] for r in result.metrics}
    if sorted(times) != list(range(1, steps + 1)):
        raise RuntimeError(f"raympi reported steps {sorted(times)[:5]}..., not 1..{steps}")
    torch.save({k: v.clone() for k, v in result.state.params.items()}, spec["params"])
    return {
        "ms_per_step": 1000 * (times[steps] - times[warmup]) / (steps - warmup),
        "launch_s": times[1] - start,
        "params": spec["params"],
    }


def run_raytrain(spec: dict[str, Any], workers: int) -> dict[str, Any]:
    res = _run_raytrain(_raytrain_loop, spec, workers, "compare")
    return {"ms_per_step": res["ms_per_step"], "launch_s": res["launch_s"], "params": spec["params"]}


RUNNERS: dict[str, Callable[[dict[str, Any], int], dict[str, Any]]] = {
    "raympi": run_raympi,
    "raympi-gloo": lambda spec, w: run_raympi(spec, w, "gloo"),
    "torchrun-ddp": run_torchrun,
    "raytrain": run_raytrain,
    "mpiexec-template": run_mpiexec,
    "floor": run_floor,
    "raw-allreduce": run_raw_allreduce,
}


# ---------------------------------------------------------------- driver


def _prepare(tmp: Path, models: list[str], workers: list[int], steps: int, warmup: int) -> dict[str, Any]:
    """Initial weights per model and one dataset per W, saved for every contender; checks of the restated helpers."""
    from raympi.driver import data as rdata

    files: dict[str, Any] = {"init": {}, "data": {}}
    for name in models:
        torch.manual_seed(SEED)
        model = mnist_example().Net() if name == "cnn" else build_model(name)
        mine = build_model(name).state_dict()
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if shapes != {k: tuple(v.shape) for k, v in mine.items()}:
            raise SystemExit("compare.py: the Net restated from examples/mnist.py differs from the imported one")
        files["init"][name] = str(tmp / f"init-{name}.pt")
        torch.save(model.state_dict(), files["init"][name])
        print(f"# {name}: {sum(p.numel() for p in model.parameters()):,} parameters", file=sys.stderr)
    for w in workers:
        n = PER_WORKER * w * warmup  # one epoch = `warmup` steps: raympi's chunks end there
        x, y = synthetic_mnist(n, SEED)
        files["data"][w] = str(tmp / f"data-W{w}.pt")
        torch.save({"x": x, "y": y}, files["data"][w])
        for step in (0, warmup - 1, warmup, steps - 1):  # the restated order must be raympi's
            epoch, i = divmod(step, n // (PER_WORKER * w))
            b = PER_WORKER * w
            theirs = rdata.rank_slices(rdata.epoch_order(SEED, epoch, n)[i * b : (i + 1) * b], w)
            if any(not torch.equal(local_indices(step, n, w, r), theirs[r]) for r in range(w)):
                raise SystemExit("compare.py: the restated data order differs from raympi.driver.data's")
    return files


def _compare(ref: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> tuple[bool, float]:
    if set(ref) != set(other):
        return False, float("inf")
    diff = max((ref[k] - other[k]).abs().max().item() for k in ref)
    return all(torch.allclose(other[k], ref[k], rtol=RTOL, atol=ATOL) for k in ref), diff


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=40, help="steps per run, warm-up included")
    p.add_argument("--warmup", type=int, default=10, help="steps not timed (also the epoch length)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--workers", default="2,4")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument(
        "--quick",
        action="store_true",
        help="1 run, cnn, W=2, 15 steps (5 warm-up), raympi + mpiexec-template + floor + raw-allreduce",
    )
    add_child_options(p)
    args = p.parse_args(argv)
    if args.child:
        _child(args.child, args.spec)
        return 0
    if args.quick:
        args.runs, args.steps, args.warmup = 1, 15, 5
        args.models, args.workers, args.contenders = "cnn", "2", "raympi,mpiexec-template,floor,raw-allreduce"
        share_one_ray(2)  # a smoke run: one Ray for every contender
    models = [m for m in args.models.split(",") if m]
    workers = [int(w) for w in args.workers.split(",") if w]
    contenders = [c for c in args.contenders.split(",") if c]
    bad = [m for m in models if m not in MODELS] + [c for c in contenders if c not in CONTENDERS]
    if bad or args.warmup < 1 or args.steps <= args.warmup:
        p.error(f"unknown {bad}" if bad else "need 1 <= warmup < steps")

    tmp = Path(tempfile.mkdtemp(prefix="raympi-compare-"))
    rows: list[dict[str, Any]] = []
    failed = False
    try:
        files = _prepare(tmp, models, workers, args.steps, args.warmup)
        for run in range(args.runs):
            for model in models:
                for w in workers:
                    params: dict[str, dict[str, torch.Tensor]] = {}
                    for name in rotated(
                        contenders, run
                    ):  # who goes first rotates, so drifts in machine speed spread out
                        tag = f"{run}-{model}-W{w}-{name}"
                        spec = write_spec(
                            tmp,
                            tag,
                            model=model,
                            init=files["init"][model],
                            data=files["data"][w],
                            workers=w,
                            steps=args.steps,
                            warmup=args.warmup,
                        )
                        row: dict[str, Any] = {
                            "run": run,
                            "model": model,
                            "workers": w,
                            "contender": name,
                            "ms_per_step": None,
                            "launch_s": None,
                            "raw_allreduce_ms": None,
                            "raw_allreduce_p10_ms": None,
                            "raw_allreduce_p90_ms": None,
                            "max_param_diff": None,
                            "params_match": "",
                            "error": "",
                        }
                        began = time.time()

                        def contend(name: str = name, spec: dict[str, Any] = spec, w: int = w) -> dict[str, Any]:
                            res = RUNNERS[name](spec, w)
                            if res["params"]:
                                params[name] = torch.load(res["params"], weights_only=True)
                            return {
                                "ms_per_step": res["ms_per_step"],
                                "launch_s": res["launch_s"],
                                **{
                                    k: res.get(k)
                                    for k in ("raw_allreduce_ms", "raw_allreduce_p10_ms", "raw_allreduce_p90_ms")
                                },
                            }

                        failed |= not attempt(
                            row, contend
                        )  # an error is recorded, reported, and the exit status says so
                        rows.append(row)
                        ms = f"{row['ms_per_step']:.2f} ms/step" if row["ms_per_step"] is not None else row["error"]
                        print(
                            f"# run {run} {model} W={w} {name}: {ms} ({time.time() - began:.1f} s)",
                            file=sys.stderr,
                            flush=True,
                        )
                    ref_name = next((c for c in COMPARED if c in params), None)
                    init = torch.load(files["init"][model], weights_only=True)
                    for row in rows[-len(contenders) :]:
                        if row["contender"] not in params:
                            row["params_match"] = "n/a" if row["contender"] in ("floor", "raw-allreduce") else "ERROR"
                            continue
                        ok, diff = _compare(params[ref_name], params[row["contender"]])
                        row["max_param_diff"] = diff
                        row["params_match"] = "ref" if row["contender"] == ref_name else ("PASS" if ok else "FAIL")
                        failed |= not ok
                    if ref_name:
                        moved = max((params[ref_name][k] - init[k]).abs().max().item() for k in init)
                        if moved < 10 * ATOL:
                            print(
                                f"# WARNING: {model} W={w}: the parameters moved only {moved:.1e} from init",
                                file=sys.stderr,
                            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    write_csv(OUT / "compare.csv", rows)
    summary = _summarize(rows, models, workers, contenders)
    _print_table(summary, args)
    _print_targets(summary, rows, models, workers)
    _plot(summary, models, workers, contenders, OUT / "compare.png")
    print(f"\nwrote {OUT / 'compare.csv'} and {OUT / 'compare.png'}")
    if failed:
        print("FAILED: a contender errored or ended with other parameters (see above)")
    return 1 if failed else 0


def _summarize(rows, models, workers, contenders) -> list[dict[str, Any]]:
    out = []
    for m in models:
        for w in workers:
            group = [r for r in rows if r["model"] == m and r["workers"] == w]
            ref = [r["ms_per_step"] for r in group if r["contender"] == "raympi" and r["ms_per_step"] is not None]
            for c in contenders:
                mine = [r for r in group if r["contender"] == c]
                ms = [r["ms_per_step"] for r in mine if r["ms_per_step"] is not None]
                launch = [r["launch_s"] for r in mine if r["launch_s"] is not None]
                marks = {r["params_match"] for r in mine}
                match = next((x for x in ("ERROR", "FAIL") if x in marks), None) or (
                    "ref" if marks == {"ref"} else "PASS" if marks <= {"PASS", "ref"} else "n/a"
                )
                diffs = [r["max_param_diff"] for r in mine if r["max_param_diff"] is not None]
                stats = min_median_max(ms)
                out.append(
                    {
                        "model": m,
                        "workers": w,
                        "contender": c,
                        **stats,
                        "ratio": stats["median"] / statistics.median(ref) if ms and ref else None,
                        "launch": median_or_none(launch),
                        "match": match,
                        "diff": max(diffs) if diffs else None,
                    }
                )
    return out


def _print_table(summary, args) -> None:
    print(
        f"\nms/step over steps {args.warmup + 1}-{args.steps} "
        f"({args.steps - args.warmup} timed after {args.warmup} warm-up), "
        f"{args.runs} run(s); batch {PER_WORKER}/worker; ratio = contender median / raympi median"
    )
    header = (
        f"{'model':5} | {'W':>2} | {'contender':16} | {'min':>8} | {'median':>8} | {'max':>8} | {'ratio':>6} | "
        f"{'launch s':>8} | params match"
    )
    print(header)
    print("-" * len(header))
    for s in summary:
        diff = f" (max diff {s['diff']:.1e})" if s["match"] in ("PASS", "FAIL") and s["diff"] is not None else ""
        print(
            f"{s['model']:5} | {s['workers']:>2} | {s['contender']:16} | {fmt(s['min'], '8.2f')} | "
            f"{fmt(s['median'], '8.2f')} | {fmt(s['max'], '8.2f')} | {fmt(s['ratio'], '6.2f')} | "
            f"{fmt(s['launch'], '8.2f')} | {s['match']}{diff}"
        )
    launches = {
        c: [s["launch"] for s in summary if s["contender"] == c and s["launch"] is not None]
        for c in ("raympi", "raytrain")
    }
    if all(launches.values()):
        a, b = statistics.median(launches["raympi"]), statistics.median(launches["raytrain"])
        print(
            f"launch to first completed step (median over models and W, Ray start excluded): raympi {a:.2f} s, "
            f"Ray Train {b:.2f} s ({b / a:.1f}x)"
        )


def _print_targets(summary, rows, models, workers) -> None:
    """raympi against DDP, the template, and the floor plus the raw allreduce of the gradients (issue 15's targets)."""
    med = {(s["model"], s["workers"], s["contender"]): s["median"] for s in summary}
    targets = {
        "mlp": {"floor+raw": 1.10, "mpiexec-template": 0.90},
        "cnn": {"torchrun-ddp": 0.65, "mpiexec-template": 0.85},
    }
    print("\nraympi vs the targets (medians of this run)")
    for m in models:
        for w in workers:
            mine = med.get((m, w, "raympi"))
            if mine is None:
                continue
            goal = targets.get(m, {}) if w == 2 else {}
            parts = [f"{m} W={w}: raympi {mine:.2f} ms"]

            def judged(name: str, ratio: float) -> str:
                return (
                    f" [target <= {goal[name]:.2f}: {'met' if ratio <= goal[name] else 'NOT met'}]"
                    if name in goal
                    else ""
                )

            for other in ("torchrun-ddp", "mpiexec-template"):
                if med.get((m, w, other)):
                    ratio = mine / med[(m, w, other)]
                    parts.append(f"{ratio:.2f}x {other}{judged(other, ratio)}")
            for source in ("raw-allreduce", "mpiexec-template"):
                raw = [
                    r
                    for r in rows
                    if r["model"] == m
                    and r["workers"] == w
                    and r["contender"] == source
                    and r["raw_allreduce_ms"]
                    and r["raw_allreduce_p10_ms"] is not None
                ]
                if raw and med.get((m, w, "floor")):
                    ms = statistics.median(r["raw_allreduce_ms"] for r in raw)
                    spread = (
                        f"p10-p90 {min(r['raw_allreduce_p10_ms'] for r in raw):.2f}-"
                        f"{max(r['raw_allreduce_p90_ms'] for r in raw):.2f}"
                    )
                    ratio = mine / (med[(m, w, "floor")] + ms)
                    where = (
                        "Ray actors, fit's transport"
                        if source == "raw-allreduce"
                        else "under mpiexec, its default transport"
                    )
                    parts.append(
                        f"{ratio:.2f}x floor {med[(m, w, 'floor')]:.2f} + raw allreduce {ms:.2f} ms ({where}, {spread})"
                        + (judged("floor+raw", ratio) if source == "raw-allreduce" else "")
                    )
            print("  " + ",\n    ".join(parts))


def _plot(summary, models, workers, contenders, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    width = 0.8 / len(contenders)
    for ax, m in zip(axes[0], models):
        for j, c in enumerate(contenders):
            xs, ys, lo, hi = [], [], [], []
            for i, w in enumerate(workers):
                s = next(s for s in summary if s["model"] == m and s["workers"] == w and s["contender"] == c)
                if s["median"] is not None:
                    xs.append(i + (j - (len(contenders) - 1) / 2) * width)
                    ys.append(s["median"])
                    lo.append(s["median"] - s["min"])
                    hi.append(s["max"] - s["median"])
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=c)
        ax.set_xticks(range(len(workers)), [f"W={w}" for w in workers])
        ax.set_ylabel("ms / step (median; bars: min-max)")
        ax.set_title(f"{m}: {PER_WORKER} samples/worker, CPU, 1 thread/worker")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
