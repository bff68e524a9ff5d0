"""raympi on a GPU machine, checked and timed in one run (under 4 minutes, Ray's start included).

Meant for one run on a 1 x H100/H200 (16 cores) machine, through ``tools/gpu_run.sh`` (one device call of
at most 5 minutes with the setup); ``--cpu`` (automatic without CUDA) runs the very same code paths on CPU
workers with tiny sizes, so the script is known not to crash before it gets its one GPU run.

Every stage runs in a child process of its own (``gpu_check.py --stage NAME``, attached to this process's Ray
as a driver of its own), killed with its process group at the stage's limit: a stage that overruns is stopped
there whatever it is blocked in (a ``fit()``, a ``ray.get``, a CUDA call), Ray ends its actors and placement
groups with its job, and the next stage runs.  Every blocking Ray call in a stage has its own timeout too.  A
stage writes its rows as it goes, so a stopped one still reports what it finished.  Stages, in order:

  env       torch, CUDA, GPU and MPI versions, the gradient transports (as ``raympi doctor`` lists them).
  parity    (c) a small MLP (fp32, SGD with momentum, 8 steps) through ``raympi.fit``: one GPU worker
            (a world of one: no gradient sync at all), and two workers sharing one GPU
            (``resources_per_worker={"GPU": 0.5}``) over ``grad_transport="mpi"`` and ``"gloo"``,
            overlap off and on, each against the same run on CPU workers over MPI.  Tolerance rtol
            1e-4, atol 1e-5: float32 sums in another order (cuBLAS vs CPU BLAS) differ by a few ulp
            per step (~1e-7 relative); a lost or doubled gradient bucket moves parameters by ~1e-2.
  nccl1     (b) the NCCL transport at world size 1 through the whole bucket path: one rank, a
            ``ProcessGroupNCCL`` built from its MPI communicator, ``make_train_step`` with the process
            group as ``grad_sync`` (tree path) and as ``BucketSync`` (overlap), float32 and bfloat16
            parameters (bf16 summed in bf16, and with ``fp32_reduce``), against no sync: parameters
            equal bit for bit, ms/step of each.  (``--cpu``: the same on gloo.)
  shard     ``shard_optimizer=True`` (AdamW with a mask, clipped): ``make_train_step`` over a NCCL process group
            at world size 1 (its reduce-scatter and all-gather) against the unsharded step with no sync;
            ``raympi.fit`` with two workers sharing GPU 0 over mpi and over gloo against unsharded CPU
            workers (rtol 1e-4, atol 1e-5).  (``--cpu``: gloo for NCCL.)
  resnet    (a) ResNet-18 (torchvision, 10 classes) on synthetic 3x64x64 images (32x32 with --cpu),
            bf16, SGD, 100 steps: ``raympi.fit`` with one worker per GPU, two workers sharing GPU 0 over mpi
            and over gloo (overlap on), and a plain single-GPU torch loop on the same batches
            (autocast bf16, pinned host batches copied to the device as the worker does).  ms/step of
            fit = global batch / its samples_per_s (median over chunks after the first);
            overhead = fit / plain (target <= 1.05).
  sync      (d) one gradient sync of 100 MB and 1 GB of float32 gradients (1 and 8 MB with --cpu),
            as 25 MB tensors, on each transport: mpi and gloo between 2 ranks sharing GPU 0 (the
            tree path and the bucket path), NCCL at world size 1 (one GPU: the most NCCL can do here).

Prints one table per stage and writes everything as JSON to $OUT/gpu_check.json when OUT is set,
else to tools/out/gpu_check.json (gpu_check_cpu.json with --cpu), after every stage.

    python tools/gpu_check.py            # on the GPU machine (bash tools/gpu_run.sh sets it up)
    python tools/gpu_check.py --cpu      # here: the same paths on CPU, tiny sizes
    python tools/gpu_check.py --cpu --stages parity,env --limit parity=3   # parity stopped at 3 s, env runs

NCCL at world size 1 only: NCCL refuses two ranks on one GPU, and the lent machine has one.  The workers (and
this script's own ranks) run with raympi's NCCL error handling (``raympi.driver.group.NCCL_ENV``).

Two workers on one GPU: ``fit(use_gpu=True, resources_per_worker={"CPU": 1, "GPU": 0.5})``.  A
``raympi.driver.capacity.worker_bundle`` that still raises a worker's GPU share to 1 (before it
honoured a fraction) is swapped for this run where the driver looks it up (:func:`_shared_gpu`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import ray
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # _common: what the benchmarks share

import raympi  # noqa: E402
from raympi import comm  # noqa: E402
from raympi.comm.buckets import BucketAllreduce  # noqa: E402
from raympi.driver.config import MPIConfig  # noqa: E402
from raympi.driver.group import NCCL_ENV  # noqa: E402

from _common import OMP1, pickle_by_value, start_local_ray  # noqa: E402

# The whole run, Ray's start included, and each stage's limit (its child process is killed there).  On the GPU
# machine gpu_run.sh's setup takes ~20-40 s of the device call's 5 minutes: 225 s here leaves room for it and
# for the machine's start.  --cpu (tests, 2 cores beside other jobs) has room to spare: it proves the paths.
BUDGET_S = {"gpu": 225, "cpu": 600}
LIMITS_S = {
    "gpu": {"env": 20, "parity": 55, "nccl1": 30, "shard": 30, "resnet": 45, "sync": 40},
    "cpu": {"env": 60, "parity": 150, "nccl1": 90, "shard": 120, "resnet": 150, "sync": 120},
}
MIN_STAGE_S = 10  # a stage that cannot get this much of the budget is skipped
KILL_GRACE_S = 3  # SIGTERM, then SIGKILL this much later


class _Stage:
    """What a stage's child knows of its run: the mode, its deadline, and where its rows go as they come."""

    def __init__(self, gpu: bool, limit_s: float, result: Path | None) -> None:
        self.gpu, self.result = gpu, result
        self.deadline = time.monotonic() + limit_s

    def left(self, margin: float = 2.0) -> float:
        """Seconds left before the stage's limit, less ``margin`` (at least 1): a blocking call's timeout."""
        return max(1.0, self.deadline - time.monotonic() - margin)

    def partial(self, result: dict[str, Any]) -> None:
        """Record what the stage has so far: the parent reports it if the stage is stopped at its limit."""
        if self.result is not None:
            _write_json(self.result, {"status": "running", "partial": result})


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


@contextlib.contextmanager
def _shared_gpu():
    """Let ``resources_per_worker={"GPU": 0.5}`` put two workers on one GPU (see the module docstring)."""
    import raympi.driver.controller  # noqa: F401  (loads the modules that look the function up)
    from raympi.driver import capacity
    from raympi.driver.config import parse_config

    if capacity.worker_bundle(parse_config(resources_per_worker={"GPU": 0.5}), True)["GPU"] == 0.5:
        yield  # fit honours the fraction itself
        return

    def bundle(cfg: Any, use_gpu: bool) -> dict[str, float]:
        out = dict(cfg.resources_per_worker)
        if use_gpu:
            out["GPU"] = out.get("GPU") or 1.0
        return out

    mods = [
        m for name, m in list(sys.modules.items()) if name.startswith("raympi.driver") and hasattr(m, "worker_bundle")
    ]
    saved = [m.worker_bundle for m in mods]
    for m in mods:
        m.worker_bundle = bundle
    try:
        yield
    finally:
        for m, fn in zip(mods, saved):
            m.worker_bundle = fn


# --------------------------------------------------------------------------- stages


def stage_env(cfg: _Stage) -> dict[str, Any]:
    from raympi.comm import library

    out = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": torch.cuda.device_count(),
        "mpi": library.library_version(),
        "cpus": os.cpu_count(),
        "mode": "gpu" if cfg.gpu else "cpu",
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "ray": ray.__version__,
        "workers' NCCL environment": NCCL_ENV,
    }
    from raympi.__main__ import transports

    out.update({f"transport {k}": v for k, v in transports().items()})
    if cfg.gpu:
        out["gpu"] = torch.cuda.get_device_name(0)
        out["bf16"] = torch.cuda.is_bf16_supported()
    return out


def _fit(model: nn.Module, data: Any, gpu: bool, workers: int, share: bool, **options: Any) -> Any:
    """One ``raympi.fit`` on the running Ray; ``share``: the workers split GPU 0."""
    res = {"CPU": 1.0, **({"GPU": 1.0 / workers} if gpu and share else {})}
    with tempfile.TemporaryDirectory() as ckpt, _shared_gpu() if share else contextlib.nullcontext():
        return raympi.fit(
            model,
            data,
            workers=workers,
            use_gpu=gpu,
            resources_per_worker=res,
            progress=False,
            checkpoint_dir=ckpt,
            startup_timeout_s=60,
            step_timeout_s=60,
            spares=0,
            keep_workers=True,  # the next fit of the same shape takes these processes (most of parity's fits)
            **options,
        )


def stage_parity(cfg: _Stage) -> dict[str, Any]:
    """(c) one GPU worker, and two workers sharing GPU 0 over MPI and over gloo, overlap off and on, against CPU
    workers."""
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(96, 32, generator=g), torch.randint(0, 10, (96,), generator=g))

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

    opts = dict(batch_size=24, epochs=2, max_steps=8, optimizer=raympi.optim.sgd(0.05, momentum=0.9), torch_threads=1)
    refs = {w: _fit(mlp(), data, False, w, False, overlap=False, grad_transport="mpi", **opts) for w in (1, 2)}
    rows: list[dict[str, Any]] = []
    cases = [("1 worker (auto: no sync in a world of one)", 1, False, None, "auto")]
    cases += [
        (f"2 workers, one GPU, {t}, overlap {'on' if o else 'off'}", 2, True, o, t)
        for t in ("mpi", "gloo")
        for o in (False, True)
    ]
    for label, workers, share, overlap, transport in cases:
        ref = refs[workers]
        # --cpu: the "device" run is a CPU run with overlap on, through the same code
        run = _fit(
            mlp(), data, cfg.gpu, workers, share, overlap=overlap if cfg.gpu else True, grad_transport=transport, **opts
        )
        diff = max((run.state.params[k] - ref.state.params[k]).abs().max().item() for k in ref.state.params)
        ok = all(
            torch.allclose(run.state.params[k], ref.state.params[k], rtol=1e-4, atol=1e-5) for k in ref.state.params
        )
        rows.append(
            {
                "case": label,
                "steps": len(run.metrics),
                "max_abs_diff": diff,
                "loss": run.metrics[-1]["loss"],
                "cpu_loss": ref.metrics[-1]["loss"],
                "match": ok,
            }
        )
        cfg.partial({"rows": rows})
    return {"rows": rows, "tolerance": "rtol 1e-4, atol 1e-5", "all_match": all(r["match"] for r in rows)}


@ray.remote
class Rank(comm.Member):
    """One rank of the direct measurements (no fit): a world-of-one NCCL step, and gradient syncs."""

    def sharded_world_of_one(self, gpu: bool) -> dict[str, Any]:
        """shard_optimizer over a NCCL process group of one rank (gloo with --cpu), against the unsharded step."""
        from raympi.comm import process_group
        from raympi.core.state import TrainState
        from raympi.core.step import make_train_step

        torch.set_num_threads(1)
        device = torch.device("cuda", 0) if gpu else torch.device("cpu")
        backend = "nccl" if gpu else "gloo"
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(64, 512, generator=g).to(device), torch.randint(0, 10, (64,), generator=g).to(device)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
        sync = process_group.connect(self.comm, backend, "127.0.0.1", 60)
        out = {}
        for name, grad_sync, shard in (("unsharded", None, False), ("sharded", sync, True)):
            step = make_train_step(model, F.cross_entropy, _shard_opt(), grad_sync=grad_sync, shard_optimizer=shard)
            state = TrainState.create(model, _shard_opt())
            for _ in range(6):
                state, _ = step(state, (x, y))
            out[name] = state
        sync.close()
        diff = max(
            (out["sharded"].params[k] - out["unsharded"].params[k]).abs().max().item() for k in out["sharded"].params
        )
        return {"case": f"make_train_step, {backend} world 1, sharded", "max_abs_diff": diff, "match": diff <= 1e-6}

    def nccl_world_of_one(self, gpu: bool) -> dict[str, Any]:
        """(b) the NCCL transport at world size 1 through the whole bucket path, against no sync at all."""
        from raympi.comm import process_group
        from raympi.core.state import TrainState
        from raympi.core.step import make_train_step

        torch.set_num_threads(1)
        device = torch.device("cuda", 0) if gpu else torch.device("cpu")
        backend = "nccl" if gpu else "gloo"  # --cpu: the same path on gloo
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(64, 512, generator=g).to(device), torch.randint(0, 10, (64,), generator=g).to(device)
        # --cpu checks the paths and the bit-for-bit match, not speed: a narrower MLP and fewer steps (bf16 matmuls
        # are slow on CPU: the GPU sizes took 35 s there, of the stage's 40 s limit)
        width, steps, warmup = (1024, 25, 5) if gpu else (256, 8, 2)
        self.comm.bucket_bytes = 2**20 if gpu else 2**18  # several buckets either way (6.4 MB, 0.8 MB of fp32)
        rows = []
        for dtype, fp32_reduce in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
            torch.manual_seed(0)
            model = nn.Sequential(
                nn.Linear(512, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
            )
            model = model.to(device, dtype)
            opt = raympi.optim.sgd(0.05, momentum=0.9)
            loss_fn = lambda out, t: F.cross_entropy(out.float(), t)  # noqa: E731
            sync = process_group.connect(self.comm, backend, "127.0.0.1", 60, fp32_reduce=fp32_reduce)
            results = {}
            for name, grad_sync, overlap in (("none", None, False), ("tree", sync, False), ("buckets", sync, True)):
                step = make_train_step(model, loss_fn, opt, grad_sync=grad_sync, overlap=overlap)
                state = TrainState.create(model, opt)
                times = []
                for i in range(steps):
                    if gpu:
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    state, metrics = step(state, (x.to(dtype), y))
                    if gpu:
                        torch.cuda.synchronize()
                    if i >= warmup:
                        times.append((time.perf_counter() - t0) * 1e3)
                results[name] = (state, statistics.median(times))
            diff = max(
                max(
                    (results[n][0].params[k].float() - results["none"][0].params[k].float()).abs().max().item()
                    for k in results["none"][0].params
                )
                for n in ("tree", "buckets")
            )
            sync.close()
            rows.append(
                {
                    "params": str(dtype).removeprefix("torch."),
                    "fp32_reduce": fp32_reduce,
                    "backend": backend,
                    "ms_no_sync": results["none"][1],
                    "ms_tree": results["tree"][1],
                    "ms_buckets": results["buckets"][1],
                    "max_abs_diff_vs_no_sync": diff,
                    "match": diff == 0.0,
                }
            )
        return {"rows": rows, "all_match": all(r["match"] for r in rows)}

    def sync_times(self, transport: str, sizes: list[int], reps: int, gpu: bool) -> dict[str, float]:
        """(d) ms of one gradient sync of each size (float32 gradients in 25 MB parameters), median of ``reps``."""
        from raympi.comm import process_group

        torch.set_num_threads(1)
        device = torch.device("cuda", 0) if gpu else torch.device("cpu")
        sync_device = torch.cuda.synchronize if gpu else (lambda: None)
        self.comm.bucket_bytes = 25 * 2**20
        out: dict[str, float] = {}
        for nbytes in sizes:
            grads = {
                f"p{i}": torch.ones(min(25 * 2**20, nbytes - i * 25 * 2**20) // 4, device=device)
                for i in range(-(-nbytes // (25 * 2**20)))
            }
            flats = list(grads.values())
            if transport == "mpi":
                paths = {"tree": lambda: self.comm.allreduce_(grads)}
                buckets = BucketAllreduce(self.comm)
                paths["buckets"] = lambda: ([buckets.start(f) for f in flats], buckets.finish())
            else:
                sync = process_group.connect(self.comm, transport, "127.0.0.1", 120)
                paths = {
                    "tree": lambda: sync(grads),
                    "buckets": lambda: ([sync.start(f) for f in flats], sync.finish()),
                }
            for name, fn in paths.items():
                times = []
                for r in range(reps + 1):
                    self.comm.barrier()
                    sync_device()
                    t0 = time.perf_counter()
                    fn()
                    sync_device()
                    if r:
                        times.append((time.perf_counter() - t0) * 1e3)
                out[f"{nbytes / 1e6:g} MB {name}"] = statistics.median(times)
            if transport == "mpi":
                buckets.close()
            else:
                sync.close()
            grads = flats = paths = None  # this size's buffers go before the next size's are made
            if gpu:
                torch.cuda.empty_cache()
        return out


def _ranks(n: int, gpu_share: float) -> list[Any]:
    """``n`` ranks, each with fit's one-host MPI environment and raympi's NCCL error handling (as fit's workers)."""
    env = {**NCCL_ENV, **MPIConfig().environment(multi_host=False)}
    return [Rank.options(num_cpus=1, num_gpus=gpu_share, runtime_env={"env_vars": env}).remote() for _ in range(n)]


def _shard_opt() -> Any:
    decay = lambda p: {n: t.ndim >= 2 for n, t in p.items()}  # noqa: E731
    return raympi.optim.chain(raympi.optim.clip_by_global_norm(1.0), raympi.optim.adamw(1e-3, mask=decay))


def stage_shard(cfg: _Stage) -> dict[str, Any]:
    """shard_optimizer: NCCL at world 1 (direct), then fit with two workers sharing GPU 0 over mpi and gloo."""
    rows: list[dict[str, Any]] = []
    ranks = _ranks(1, 1 if cfg.gpu else 0)
    try:
        comm.form(ranks, timeout_s=min(60, cfg.left()))
        rows.append(ray.get(ranks[0].sharded_world_of_one.remote(cfg.gpu), timeout=cfg.left()))
    finally:
        ray.kill(ranks[0])
    cfg.partial({"rows": rows})
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(96, 32, generator=g), torch.randint(0, 10, (96,), generator=g))

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))

    opts = dict(batch_size=24, epochs=1, max_steps=4, optimizer=_shard_opt(), torch_threads=1)
    ref = _fit(mlp(), data, False, 2, False, grad_transport="mpi", **opts)
    for transport in ("mpi", "gloo"):
        run = _fit(mlp(), data, cfg.gpu, 2, True, grad_transport=transport, shard_optimizer=True, **opts)
        diff = max((run.state.params[k] - ref.state.params[k]).abs().max().item() for k in ref.state.params)
        ok = all(
            torch.allclose(run.state.params[k], ref.state.params[k], rtol=1e-4, atol=1e-5) for k in ref.state.params
        )
        rows.append({"case": f"fit, 2 workers on one GPU, {transport}, sharded", "max_abs_diff": diff, "match": ok})
        cfg.partial({"rows": rows})
    return {"rows": rows, "all_match": all(r["match"] for r in rows)}


def stage_nccl1(cfg: _Stage) -> dict[str, Any]:
    ranks = _ranks(1, 1 if cfg.gpu else 0)
    try:
        comm.form(ranks, timeout_s=min(60, cfg.left()))
        return ray.get(ranks[0].nccl_world_of_one.remote(cfg.gpu), timeout=cfg.left())
    finally:
        ray.kill(ranks[0])


def stage_sync(cfg: _Stage) -> dict[str, Any]:
    """(d) one gradient sync of 100 MB and 1 GB: mpi and gloo between 2 ranks sharing GPU 0; nccl at world 1.

    Each transport gets an equal share of what is left of the stage: one that runs past it is reported as
    timed out, its ranks killed, and the next one runs."""
    sizes, reps = ([100 * 10**6, 10**9], 2) if cfg.gpu else ([10**6, 8 * 10**6], 2)
    todo = [(t, w) for t, w in (("mpi", 2), ("gloo", 2), ("nccl", 1)) if cfg.gpu or t != "nccl"]
    rows: list[dict[str, Any]] = []
    for i, (transport, world) in enumerate(todo):
        share = cfg.left() / (len(todo) - i)
        ranks = _ranks(world, (1.0 / world) if cfg.gpu else 0)
        began = time.monotonic()
        try:
            comm.form(ranks, timeout_s=share)
            refs = [r.sync_times.remote(transport, sizes, reps, cfg.gpu) for r in ranks]
            ms = ray.get(refs, timeout=max(1.0, share - (time.monotonic() - began)))[0]
            rows.append({"transport": transport, "ranks": world, **ms})
        except Exception as exc:
            rows.append({"transport": transport, "ranks": world, "error": f"{type(exc).__name__}: {exc}"[:300]})
        finally:
            for r in ranks:
                ray.kill(r)
        cfg.partial({"rows": rows, "sizes_bytes": sizes})
    return {"rows": rows, "sizes_bytes": sizes}


def _resnet() -> nn.Module:
    """torchvision's ResNet-18 (10 classes); the same network built here where torchvision is missing (the
    GPU machine may lack it, and it does not fit in the carry)."""
    torch.manual_seed(0)
    try:
        import torchvision
    except ImportError:
        return _ResNet18()
    return torchvision.models.resnet18(num_classes=10)


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.down(x))


class _ResNet18(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        widths, layers, cin = (64, 128, 256, 512), [], 64
        for i, w in enumerate(widths):
            layers += [_Block(cin, w, 1 if i == 0 else 2), _Block(w, w, 1)]
            cin = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


def _plain_loop(x: torch.Tensor, y: torch.Tensor, batch: int, steps: int, device: torch.device) -> float:
    """ms/step of a plain torch loop on one device: pinned batch copied in, autocast bf16, SGD."""
    model = _resnet().to(device).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(steps + 5):
        lo = (i * batch) % (len(x) - batch + 1)
        xb, yb = x[lo : lo + batch], y[lo : lo + batch]
        sync()
        start = time.perf_counter()
        if device.type == "cuda":
            xb, yb = xb.pin_memory().to(device, non_blocking=True), yb.pin_memory().to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        loss.item()  # raympi's step reads its metrics back once
        sync()
        if i >= 5:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _fit_ms(result: Any, global_batch: int) -> float:
    rates = [m["samples_per_s"] for m in result.metrics]
    chunks = [r for i, r in enumerate(rates) if i == 0 or r != rates[i - 1]][
        1:
    ] or rates  # one rate per chunk, not the first
    return global_batch / statistics.median(chunks) * 1e3


def stage_resnet(cfg: _Stage) -> dict[str, Any]:
    size, batch, steps, n = (64, 128, 100, 4096) if cfg.gpu else (32, 4, 6, 32)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 3, size, size, generator=g), torch.randint(0, 10, (n,), generator=g)
    device = torch.device("cuda", 0) if cfg.gpu else torch.device("cpu")
    opts = dict(
        max_steps=steps,
        precision="bf16",
        optimizer=raympi.optim.sgd(0.01, momentum=0.9),
        torch_threads=2 if cfg.gpu else 1,
    )
    rows: list[dict[str, Any]] = []
    plain = _plain_loop(x, y, batch, steps, device)
    rows.append(
        {
            "case": "plain torch loop, 1 device",
            "global_batch": batch,
            "ms_per_step": plain,
            "ms_per_sample": plain / batch,
        }
    )
    cfg.partial({"rows": rows})
    gpus = max(1, torch.cuda.device_count()) if cfg.gpu else 1
    for label, workers, share, overlap, transport in (
        (f"raympi.fit, {gpus} worker(s), one per GPU", gpus, False, None, "auto"),
        ("raympi.fit, 2 workers on GPU 0, mpi, overlap on", 2, True, True, "mpi"),
        ("raympi.fit, 2 workers on GPU 0, gloo, overlap on", 2, True, True, "gloo"),
    ):
        try:  # bounded by fit's own deadlines, and by the stage's limit (its process is killed there)
            result = _fit(
                _resnet(),
                (x, y),
                cfg.gpu,
                workers,
                share,
                batch_size=batch * workers,
                overlap=overlap,
                epochs=steps * batch * workers // n + 1,
                grad_transport=transport,
                **opts,
            )
            ms = _fit_ms(result, batch * workers)
            rows.append(
                {
                    "case": label,
                    "global_batch": batch * workers,
                    "ms_per_step": ms,
                    "ms_per_sample": ms / (batch * workers),
                    "vs_plain_per_sample": (ms / (batch * workers)) / (plain / batch),
                    "final_loss": result.metrics[-1]["loss"],
                }
            )
        except Exception as exc:
            rows.append({"case": label, "error": f"{type(exc).__name__}: {exc}"[:300]})
        cfg.partial({"rows": rows})
    one = rows[1].get("vs_plain_per_sample")
    return {
        "rows": rows,
        "image": f"3x{size}x{size}",
        "overhead_1_worker": one,
        "target_met": None if one is None else one <= 1.05,
    }


# --------------------------------------------------------------------------- report


def _print(name: str, result: dict[str, Any]) -> None:
    print(f"\n== {name}: {result.get('status')} ({result.get('seconds', 0):.1f} s)", flush=True)
    body = result.get("result") or {}
    if "error" in result:
        print("   " + result["error"].strip().replace("\n", "\n   "))
    for row in body.get("rows", []):
        print("   " + " | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    for k, v in body.items():
        if k == "rows":
            continue
        if isinstance(v, dict):
            for kk, vv in v.items():
                print(f"   {kk:<42} {vv:10.2f} ms" if isinstance(vv, float) else f"   {kk}: {vv}")
        else:
            print(f"   {k}: {v:.4g}" if isinstance(v, float) else f"   {k}: {v}")
    sys.stdout.flush()


STAGES = {
    "env": stage_env,
    "parity": stage_parity,
    "nccl1": stage_nccl1,
    "shard": stage_shard,
    "resnet": stage_resnet,
    "sync": stage_sync,
}


def _child(args: argparse.Namespace) -> int:
    """``--stage NAME``: run one stage in this process, a driver attached to the parent's Ray; its result (or its
    traceback) goes to ``--result`` as JSON, and its rows as they come (:meth:`_Stage.partial`)."""
    stage = _Stage(not args.cpu, args.limit_s, Path(args.result))
    try:
        if args.stage != "env":
            pickle_by_value()
            ray.init(address=args.address, logging_level="ERROR", runtime_env={"env_vars": dict(OMP1)})
        _write_json(stage.result, {"status": "ok", "result": STAGES[args.stage](stage)})
        return 0
    except Exception:
        _write_json(stage.result, {"status": "failed", "error": traceback.format_exc(limit=6)[-3000:]})
        return 1
    finally:  # the kept workers hold their CPUs and GPU shares until released (or this job ends)
        with contextlib.suppress(Exception):
            raympi.release_workers()


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the child's process group, SIGKILL after :data:`KILL_GRACE_S`."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _run_stage(name: str, limit_s: float, gpu: bool, address: str | None, tmp: Path) -> dict[str, Any]:
    """Run stage ``name`` as a child process (its own process group) and stop it at ``limit_s``."""
    result = tmp / f"{name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", name, "--result", str(result)]
    cmd += ["--limit-s", f"{limit_s:.1f}", "--address", address or ""] + ([] if gpu else ["--cpu"])
    entry: dict[str, Any] = {"limit_s": round(limit_s, 1)}
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        rc: int | None = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        rc = None
        _stop(proc)
    try:
        got = json.loads(result.read_text())
    except (OSError, ValueError):
        got = {}
    if got.get("status") == "ok":  # done, even if its process then lingered past the limit
        entry.update({k: v for k, v in got.items() if k in ("status", "result")})
        if rc is None:
            entry["note"] = f"its process was stopped at the {limit_s:.0f} s limit after the stage had ended"
    elif rc is None:  # stopped; what it raised on SIGTERM (fit: PreemptedError) is a consequence, kept as detail
        entry.update(status="timeout", error=f"stopped at its {limit_s:.0f} s limit (process group killed)")
        if got.get("partial"):
            entry["result"] = got["partial"]
        if got.get("error"):
            entry["error"] += "; then: " + got["error"].strip().splitlines()[-1][:300]
    elif got.get("status") == "failed":
        entry.update({k: v for k, v in got.items() if k in ("status", "error")})
    else:
        entry.update(status="failed", error=f"the stage's process exited {rc} without a result")
        if got.get("partial"):
            entry["result"] = got["partial"]
    return entry


def _settle(timeout_s: float = 15.0) -> None:
    """Wait (a little) until the last stage's job has given Ray back its CPUs and GPUs: its actors and
    placement groups end with it (at once when it exits; a stopped one's within a second or two here)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with contextlib.suppress(Exception):
            total, free = ray.cluster_resources(), ray.available_resources()
            if all(free.get(k, 0) >= total.get(k, 0) for k in ("CPU", "GPU")):
                return
        time.sleep(0.2)


def _parse_limits(items: list[str]) -> dict[str, float]:
    out = {}
    for item in ",".join(items).split(","):
        if item.strip():
            name, _, seconds = item.partition("=")
            if name.strip() not in STAGES or not seconds:
                raise SystemExit(f"--limit {item!r}: expected STAGE=SECONDS with STAGE one of {', '.join(STAGES)}")
            out[name.strip()] = float(seconds)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="CPU workers, tiny sizes (automatic without CUDA)")
    ap.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset, run in the order given")
    ap.add_argument(
        "--limit", action="append", default=[], metavar="STAGE=S", help="a stage's limit in seconds (repeatable)"
    )
    ap.add_argument("--budget", type=float, help="seconds for the whole run (default: 225 on GPU, 600 with --cpu)")
    ap.add_argument("--stage", help=argparse.SUPPRESS)  # a stage's child process (see _child)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--limit-s", type=float, default=60.0, help=argparse.SUPPRESS)
    cfg = ap.parse_args(argv)
    if cfg.stage:
        raise SystemExit(_child(cfg))
    gpu = not cfg.cpu and torch.cuda.is_available()
    mode = "gpu" if gpu else "cpu"
    limits = {**LIMITS_S[mode], **_parse_limits(cfg.limit)}
    budget = min(BUDGET_S[mode], cfg.budget) if cfg.budget else BUDGET_S[mode]
    names = [n for n in cfg.stages.split(",") if n]
    unknown = [n for n in names if n not in STAGES]
    if unknown:
        raise SystemExit(f"--stages: unknown {unknown}; known: {', '.join(STAGES)}")
    began = time.monotonic()
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).resolve().parent / "out"
    out_file = out_dir / ("gpu_check.json" if gpu else "gpu_check_cpu.json")
    report: dict[str, Any] = {"mode": mode, "budget_s": budget, "limits_s": limits, "stages": {}}
    print(f"gpu_check: {'GPU' if gpu else 'CPU (--cpu or no CUDA): the same paths, tiny sizes'}", flush=True)
    print(f"   budget {budget:.0f} s; limits: " + ", ".join(f"{n} {limits[n]:.0f} s" for n in names), flush=True)
    address = None
    try:
        t0 = time.monotonic()
        start_local_ray(os.cpu_count() or 1, env=OMP1, num_gpus=torch.cuda.device_count() if gpu else 0)
        address = ray.get_runtime_context().gcs_address
        report["ray_start_s"] = time.monotonic() - t0
    except Exception as exc:
        report["ray_start_error"] = f"{type(exc).__name__}: {exc}"
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        for name in names:
            left = budget - (time.monotonic() - began)
            entry: dict[str, Any]
            start = time.monotonic()
            if left < MIN_STAGE_S:
                entry = {"status": "skipped (time budget)"}
            elif name != "env" and address is None:
                entry = {"status": "skipped (Ray did not start)"}
            else:
                entry = _run_stage(name, min(limits[name], left), gpu, address, Path(tmp))
                if address is not None:
                    _settle()
            entry["seconds"] = time.monotonic() - start
            report["stages"][name] = entry
            _print(name, entry)
            try:  # written after every stage: a later hang still leaves the rest
                out_dir.mkdir(parents=True, exist_ok=True)
                _write_json(out_file, {**report, "total_s": time.monotonic() - began})
            except OSError as exc:
                print(f"could not write {out_file}: {exc}")
    with contextlib.suppress(Exception):
        ray.shutdown()
    report["total_s"] = time.monotonic() - began
    _write_json(out_file, report)
    print(f"\ntotal {report['total_s']:.0f} s; JSON: {out_file}", flush=True)
    return report


if __name__ == "__main__":
    main()
