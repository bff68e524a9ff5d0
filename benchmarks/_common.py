"""What the benchmarks share: the local Ray start, a cluster of 1-CPU nodes, the child-process runner, the torchrun
and Ray Train contenders, the MNIST-shaped data and models, medians and spreads, and the CSV and table writers.

Every script in benchmarks/ may import this module, and no script imports another.  A script run as
``python benchmarks/<script>.py`` finds it beside itself (Python puts the script's folder first on
``sys.path``); so do its torchrun and mpiexec children, which run the script again.

Nothing here imports torch or Ray at the top: the torchrun / mpiexec children and scale.py's light
members (Ray actors in which ``import torch`` fails) load only what they call.  Ray's workers cannot
import this module (benchmarks/ is not on their path): :func:`start_local_ray` (or :func:`pickle_by_value`
where a script starts Ray otherwise) has Ray ship what they use of it by value.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import csv
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
OUT = BENCH / "out"
MNIST_EXAMPLE = ROOT / "examples" / "mnist.py"
BIN = Path(sys.executable).parent

PER_WORKER = 32  # samples per worker and step in the comparisons
LR = 0.01  # their SGD learning rate
SEED = 0
CHILD_TIMEOUT_S = 600
OMP1 = {"OMP_NUM_THREADS": "1"}


# ---------------------------------------------------------------- Ray


def pickle_by_value() -> None:
    """Have Ray (cloudpickle) ship this module's functions and classes by value: its workers cannot import it."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def start_local_ray(
    num_cpus: int,
    *,
    env: Optional[dict[str, str]] = None,
    log_to_driver: bool = True,
    dashboard: Optional[bool] = False,
    **kwargs: Any,
) -> None:
    """``ray.init(address="local", num_cpus=...)``: a fresh Ray instance of this process, quiet
    (``logging_level="ERROR"``).

    ``env``: every worker's environment variables (``runtime_env``); ``dashboard=None``: Ray's default (started when
    its dependencies are there); other keywords go to ``ray.init`` as they are.
    """
    import ray

    pickle_by_value()
    if env is not None:
        kwargs["runtime_env"] = {"env_vars": dict(env)}
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=dashboard,
        logging_level="ERROR",
        log_to_driver=log_to_driver,
        **kwargs,
    )


@contextlib.contextmanager
def local_ray(num_cpus: int, **kwargs: Any) -> Iterator[None]:
    """:func:`start_local_ray` for the block, ``ray.shutdown()`` after it."""
    import ray

    start_local_ray(num_cpus, **kwargs)
    try:
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def one_cpu_nodes(nodes: int) -> Iterator[Any]:
    """A ``ray.cluster_utils.Cluster`` of a 0-CPU head (the driver) and ``nodes`` 1-CPU nodes for the block, Ray
    attached to it (workers with OMP_NUM_THREADS=1, their logs not relayed); then Ray and the cluster shut down."""
    import ray
    from ray.cluster_utils import Cluster

    # No dashboard, no fixed port (a head's default: 8265 for the dashboard, 52365 for its agent).
    head = {"num_cpus": 0, "include_dashboard": False, "dashboard_port": None, "dashboard_agent_listen_port": 0}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        for _ in range(nodes):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False, runtime_env={"env_vars": OMP1})
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


_ONE_RAY: dict[str, bool] = {"on": False}  # whether share_one_ray() started the Ray every fresh_ray() now uses
FRESH_RAY: dict[str, Any] = {"env": OMP1, "log_to_driver": False}  # a contender's Ray: 1 thread, logs not relayed


def share_one_ray(num_cpus: int) -> None:
    """A smoke run (``--quick``): one local Ray (as :func:`fresh_ray` starts it) for every contender, up until the
    process exits, and raympi's fits of one shape in the same worker processes (:func:`keep_workers`).  A start
    costs ~3.5 s and ~5 CPU-s on 2 cores, a worker process ~2.7 CPU-s, and a smoke run's figures are not quoted; a
    full run's contenders each get a fresh instance and fresh processes."""
    start_local_ray(num_cpus, **FRESH_RAY)
    _ONE_RAY["on"] = True


def keep_workers() -> bool:
    """``raympi.fit(keep_workers=...)`` for a contender: after :func:`share_one_ray` only.  A contender that is not a
    ``fit`` ends the kept workers first (:func:`release_kept_workers`): they hold their CPUs."""
    return _ONE_RAY["on"]


def release_kept_workers() -> None:
    """End the worker processes raympi's fits kept (:func:`keep_workers`), if raympi is loaded."""
    if "raympi" in sys.modules:
        sys.modules["raympi"].release_workers()


@contextlib.contextmanager
def fresh_ray(workers: int) -> Iterator[None]:
    """The Ray a contender of the comparisons runs on: one fresh local instance of ``workers`` CPUs, workers with
    OMP_NUM_THREADS=1, their logs not relayed to the driver; shut down after the block.  After
    :func:`share_one_ray`: that instance, left running."""
    if _ONE_RAY["on"]:
        yield
        return
    with local_ray(workers, **FRESH_RAY):
        yield


def time_reps(barrier: Callable[[], Any], fn: Callable[[], Any], reps: int) -> list[float]:
    """Seconds of ``fn()`` each of ``reps`` times, each timed from a ``barrier()``, after one untimed call (a warm-up:
    the first sets up the connections).  Runs in the ranks (Ray actors)."""
    times = []
    for _ in range(reps + 1):
        barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times[1:]


CHUNK_GAP_S = 1e-3  # raympi's metrics records further apart than this came in different chunks


def steady_samples_per_s(metrics: list[dict[str, Any]], steps: int, warmup: int, global_batch: int) -> float:
    """raympi's steady samples/s from the driver-observed times of ``fit``'s records: from the end of the chunk
    holding step ``warmup`` to the last step (the records of a chunk are stamped microseconds apart as it arrives,
    chunks at least a step apart)."""
    times = {r["step"]: r["time"] for r in metrics}
    if sorted(times) != list(range(1, steps + 1)):
        raise RuntimeError(f"raympi reported steps {sorted(times)[:5]}..., not 1..{steps}")
    ends = [s for s in range(1, steps) if times[s + 1] - times[s] > CHUNK_GAP_S]
    if not ends:
        raise RuntimeError(f"all {steps} steps came in one chunk: raise --steps")
    s0 = min((s for s in ends if s >= warmup), default=ends[-1])
    return global_batch * (steps - s0) / (times[steps] - times[s0])


def fit_throughput(
    model: Any,
    dataset: Any,
    length: int,
    spec: dict[str, Any],
    world: int,
    global_batch: int,
    lr: float,
    loader_workers: Optional[int],
) -> dict[str, float]:
    """``raympi.fit`` for ``spec["steps"]`` steps (SGD ``lr``, 1 torch thread per worker, no checkpoint until
    the end) on a :func:`fresh_ray` of ``world`` CPUs: its steady samples/s (:func:`steady_samples_per_s`
    after ``spec["warmup"]`` steps) and ``start_s``, from ``fit()`` to the end of the first step."""
    import raympi

    with fresh_ray(world):
        start = time.time()
        result = raympi.fit(
            model,
            dataset,
            workers=world,
            epochs=-(-spec["steps"] // (length // global_batch)),
            max_steps=spec["steps"],
            batch_size=global_batch,
            optimizer=raympi.optim.sgd(lr),
            progress=False,
            seed=SEED,
            torch_threads=1,
            loader_workers=loader_workers,
            checkpoint_dir=spec["dir"] + "/raympi-ckpt",
            checkpoint_every=0,
            keep_workers=keep_workers(),
        )
    return {
        "samples_per_s": steady_samples_per_s(result.metrics, spec["steps"], spec["warmup"], global_batch),
        "start_s": result.metrics[0]["time"] - start,
    }


def slowest_median(per_rank: Iterable[Sequence[float]]) -> float:
    """The median over the repetitions of the slowest rank's time (``per_rank``: each rank's times, rep by rep)."""
    return statistics.median(max(rep) for rep in zip(*per_rank))


# ---------------------------------------------------------------- child processes


def run_child(cmd: list[str], timeout_s: float) -> tuple[int, str]:
    """Run ``cmd`` from the repository root in a process group of its own (OMP_NUM_THREADS=1, unbuffered output,
    stderr into stdout); returns (exit status, output).  Past ``timeout_s`` the whole group (torchrun or mpiexec
    and its ranks) is killed and RuntimeError raised with the end of the output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # our own child's process group
        output, _ = proc.communicate()
        raise RuntimeError(f"timed out after {timeout_s:.0f} s: {output[-1500:]}")
    return proc.returncode, output


def run_spec_child(cmd: list[str], spec: dict[str, Any], timeout_s: float = CHILD_TIMEOUT_S) -> dict[str, Any]:
    """A contender run as a child process: :func:`run_child`, then rank 0's result file ``spec["result"]`` (JSON with
    ``first_step_wall``, the wall time at the end of its first step), plus ``launch_s`` (launch to that moment) and
    ``params`` (``spec["params"]``, where rank 0 saved its final parameters).  RuntimeError if it failed."""
    launch = time.time()
    code, output = run_child(cmd, timeout_s)
    if code != 0 or not Path(spec["result"]).exists():
        raise RuntimeError(f"exit {code}: {output[-1500:]}")
    res = json.loads(Path(spec["result"]).read_text())
    return {**res, "launch_s": res["first_step_wall"] - launch, "params": spec["params"]}


def write_spec(folder: Path, tag: str, **fields: Any) -> dict[str, Any]:
    """One contender run's spec, written to ``<folder>/<tag>.json`` for its children to read (:func:`read_spec`):
    ``fields`` and ``dir`` (``folder``), ``path`` (the spec's own file), ``result`` (where rank 0 writes its result)
    and ``params`` (where it saves its final parameters)."""
    spec = {
        **fields,
        "dir": str(folder),
        "path": str(folder / f"{tag}.json"),
        "result": str(folder / f"{tag}.result.json"),
        "params": str(folder / f"{tag}.params.pt"),
    }
    Path(spec["path"]).write_text(json.dumps(spec))
    return spec


def read_spec(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def add_child_options(parser: argparse.ArgumentParser) -> None:
    """The hidden options a script's children are started with (``<script> --child MODE --spec PATH``: a torchrun
    or mpiexec rank, see :func:`run_torchrun`)."""
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)


# ---------------------------------------------------------------- torchrun + DDP and Ray Train, the peers


def run_torchrun(script: str, spec: dict[str, Any], workers: int, timeout_s: float = CHILD_TIMEOUT_S) -> dict[str, Any]:
    """``torchrun --standalone --nproc_per_node workers <script> --child ddp --spec <spec["path"]>``: the script's
    ranks join with :func:`torchrun_gloo`; returns :func:`run_spec_child`'s result."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={workers}",
        str(Path(script).resolve()),
        "--child",
        "ddp",
        "--spec",
        spec["path"],
    ]
    return run_spec_child(cmd, spec, timeout_s)


@contextlib.contextmanager
def torchrun_gloo() -> Iterator[tuple[int, int, Callable[[], Any]]]:
    """In a torchrun rank: the gloo process group of torchrun's environment for the block, as (rank, world, barrier)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    yield dist.get_rank(), dist.get_world_size(), dist.barrier
    dist.destroy_process_group()


def ddp(model: Any) -> Any:
    """``model`` in DistributedDataParallel (the default process group)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def dataloader_loop(
    spec: dict[str, Any], rank: int, world: int, model: Any, barrier: Callable[[], Any], dataset: Any, per_rank: int
) -> None:
    """A DDP rank's training: ``DataLoader(dataset, per_rank, DistributedSampler, num_workers=1)``, SGD
    ``spec["lr"]``, cross-entropy, ``spec["steps"]`` steps timed between two barriers after ``spec["warmup"]``;
    rank 0 writes ``spec["result"]`` (``ms_per_step``, ``first_step_wall``, ``world``)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=SEED, drop_last=True)
    loader = DataLoader(dataset, batch_size=per_rank, sampler=sampler, num_workers=1, drop_last=True)
    opt = torch.optim.SGD(model.parameters(), lr=spec["lr"])
    steps, warmup = spec["steps"], spec["warmup"]
    epoch, batches = 0, iter(loader)
    first_step_wall = t0 = None
    for s in range(steps):
        if s == warmup:
            barrier()
            t0 = time.perf_counter()
        try:
            x, y = next(batches)
        except StopIteration:  # a dataset shorter than the run
            epoch += 1
            sampler.set_epoch(epoch)
            batches = iter(loader)
            x, y = next(batches)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if s == 0:
            first_step_wall = time.time()
    barrier()
    elapsed = time.perf_counter() - t0
    if rank == 0:
        result = {"ms_per_step": 1000 * elapsed / (steps - warmup), "first_step_wall": first_step_wall, "world": world}
        Path(spec["result"]).write_text(json.dumps(result))


def raytrain_ddp(model: Any) -> tuple[Any, int, int, Callable[[], Any]]:
    """In Ray Train's train_loop_per_worker: (``model`` through ``prepare_model`` (DDP over the gloo group that
    TorchTrainer set up), this worker's rank, the world size, the group's barrier)."""
    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    ctx = ray.train.get_context()
    return ray.train.torch.prepare_model(model), ctx.get_world_rank(), ctx.get_world_size(), dist.barrier


def run_raytrain(
    loop: Callable[[dict[str, Any]], None], spec: dict[str, Any], workers: int, name: str
) -> dict[str, Any]:
    """Ray Train's TorchTrainer running ``loop(spec)`` on ``workers`` workers (CPU) on a :func:`fresh_ray`; its rank 0
    writes ``spec["result"]`` as a child of :func:`run_spec_child` does.  Returns that result with ``launch_s``
    (``trainer.fit()`` to the end of rank 0's first step)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    release_kept_workers()
    with fresh_ray(workers):
        trainer = TorchTrainer(
            loop,
            train_loop_config=spec,
            scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
            run_config=RunConfig(name=name, storage_path=spec["dir"] + "/raytrain-storage"),
        )
        start = time.time()
        trainer.fit()
    res = json.loads(Path(spec["result"]).read_text())
    return {**res, "launch_s": res["first_step_wall"] - start}


# ---------------------------------------------------------------- data and models


def mnist_example() -> Any:
    """examples/mnist.py imported for real (importlib; it imports raympi) once per process, as module
    ``raympi_examples_mnist``, shipped to Ray workers by value."""
    name = "raympi_examples_mnist"
    if name not in sys.modules:  # (not a global of this module: this function may itself travel by value)
        import importlib.util

        import ray.cloudpickle

        spec = importlib.util.spec_from_file_location(name, MNIST_EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        ray.cloudpickle.register_pickle_by_value(module)
    return sys.modules[name]


def example_net_class() -> type:
    """``Net`` from examples/mnist.py's source, its class alone.

    Importing the example imports raympi (and with it Ray, ~4 s, and mpi4py with MPI_Init turned off), which
    torchrun / mpiexec ranks should not pay or inherit.
    """
    import torch
    from torch import nn

    tree = ast.parse(MNIST_EXAMPLE.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Net"]
    namespace: dict[str, Any] = {"torch": torch, "nn": nn, "__name__": "examples_mnist_net"}
    exec(compile(ast.Module(body=[cls], type_ignores=[]), str(MNIST_EXAMPLE), "exec"), namespace)
    return namespace["Net"]


def example_defs() -> dict[str, Any]:
    """The top-level definitions of examples/mnist.py (``Net``, ``augmented``, ``load``...) without ``import raympi``
    (nor its ``main`` and ``if __name__`` block): for torchrun ranks and Ray Train's workers."""
    tree = ast.parse(MNIST_EXAMPLE.read_text())
    body = [
        n
        for n in tree.body
        if not (isinstance(n, ast.Import) and any(a.name == "raympi" for a in n.names))
        and not (isinstance(n, ast.FunctionDef) and n.name == "main")
        and not isinstance(n, ast.If)
    ]
    namespace: dict[str, Any] = {"__name__": "raympi_bench_mnist_defs"}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(MNIST_EXAMPLE), "exec"), namespace)
    return namespace


def mlp() -> Any:
    """The MLP 784-2048-2048-10 (5.8M parameters, 23.3 MB of float32 gradients)."""
    from torch import nn

    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)
    )


def synthetic_mnist(n: int, seed: int = SEED) -> tuple[Any, Any]:
    """``n`` MNIST-shaped samples: (standard normal images (n, 1, 28, 28), labels 0-9), from a generator seeded
    ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


# ---------------------------------------------------------------- runs, medians, tables and files


def rotated(items: Sequence[Any], run: int) -> list[Any]:
    """``items`` starting at ``run``'s turn: who goes first rotates run by run, so drifts in machine speed spread
    out."""
    k = run % len(items)
    return list(items[k:]) + list(items[:k])


def error_line(exc: BaseException) -> str:
    """``Type: last line of the message``, for a table's or a CSV's error column."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"


def attempt(row: dict[str, Any], fn: Callable[[], dict[str, Any]]) -> bool:
    """``row.update(fn())``; an exception is recorded in ``row["error"]`` (:func:`error_line`), its traceback printed
    on stderr.  True when ``fn`` returned."""
    try:
        row.update(fn())
        return True
    except Exception as exc:  # recorded, reported, and the caller's exit status says so
        row["error"] = error_line(exc)
        traceback.print_exc(file=sys.stderr)
        return False


def spread(seconds: list[float], prefix: str = "") -> dict[str, float]:
    """Median and 10th/90th percentiles of ``seconds``, in ms."""
    q = statistics.quantiles(seconds, n=10)
    return {
        f"{prefix}ms": 1000 * statistics.median(seconds),
        f"{prefix}p10_ms": 1000 * q[0],
        f"{prefix}p90_ms": 1000 * q[-1],
    }


def median_or_none(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def min_median_max(values: list[float]) -> dict[str, Any]:
    """``{"n", "min", "median", "max"}`` of ``values``, None for each but ``n`` where there are none."""
    return {
        "n": len(values),
        "min": min(values) if values else None,
        "median": median_or_none(values),
        "max": max(values) if values else None,
    }


def median_range(values: list[float], f: str) -> str:
    """``median (min-max)``, each formatted with ``f``; a ``-`` as wide where there are no values."""
    if not values:
        return f"{'-':>{len(format(0.0, f)) * 3 + 4}}"
    return f"{format(statistics.median(values), f)} ({format(min(values), f)}-{format(max(values), f)})"


def fmt(value: Optional[float], f: str) -> str:
    """``value`` formatted with ``f``, or a ``-`` as wide as ``f``'s width where it is None."""
    return format(value, f) if value is not None else format("-", ">" + f.split(".")[0])


def write_csv(path: Path, rows: Iterable[dict[str, Any]], fields: Optional[list[str]] = None, **options: Any) -> None:
    """``rows`` as CSV at ``path`` (its folder made); columns ``fields``, by default the first row's keys (``rows``
    a list then); ``options`` go to csv.DictWriter (``extrasaction="ignore"``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields if fields is not None else list(rows[0]), **options)
        writer.writeheader()
        writer.writerows(rows)


def save_results(stem: str, rows: list[dict[str, Any]], table: str) -> None:
    """``OUT/<stem>.csv`` (every row) and ``OUT/<stem>.txt`` (the table); the table printed, then where both went."""
    write_csv(OUT / f"{stem}.csv", rows)
    (OUT / f"{stem}.txt").write_text(table + "\n")
    print("\n" + table)
    print(f"\nwrote {OUT / (stem + '.csv')} and {OUT / (stem + '.txt')}")


def raylet_pids(nodes: list[Any]) -> set[int]:
    """The raylets' pids of ``nodes`` (``ray.cluster_utils`` nodes, or the local node of ``ray.init``)."""
    from ray._private import ray_constants

    return {
        info.process.pid for node in nodes for info in node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, [])
    }


def own_raylets() -> set[int]:
    """The raylet of the Ray instance this driver started (ray.init(address="local"))."""
    import ray._private.worker

    return raylet_pids([ray._private.worker._global_node])


def ray_processes(prefix: str, raylets: set[int]) -> list[Any]:
    """Live processes titled ``prefix``... (Ray titles actors 'ray::<Class>...') started by one of ``raylets``.

    Only our own Ray instance's: other Ray instances on the machine (other people's tests) are left alone.
    """
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = p.info["cmdline"] or []
            if cmd and cmd[0].startswith(prefix) and p.info["status"] != psutil.STATUS_ZOMBIE:
                if any(parent.pid in raylets for parent in p.parents()):
                    found.append(p)
        except psutil.Error:
            pass
    return found


def training_workers(raylets: set[int], watch_s: float = 0.3, patience_s: float = 10.0) -> list[Any]:
    """raympi's Worker processes that are training: seen running ``Worker.run`` (Ray titles a process
    ``ray::Worker.run`` while it runs that task) within ``watch_s``, or until one is seen (at most
    ``patience_s``: a starved machine may take minutes to start its workers). A hot spare idles or joins
    the standby communicator; CPU use cannot tell them apart on a machine loaded many times over, where
    the ranks get little of a core."""
    seen: dict[int, Any] = {}
    started = time.monotonic()
    while time.monotonic() - started < watch_s or (not seen and time.monotonic() - started < patience_s):
        seen.update((p.pid, p) for p in ray_processes("ray::Worker.run", raylets))
        time.sleep(0.01)
    if not seen:
        raise RuntimeError("found no training raympi worker")
    return [p for _, p in sorted(seen.items()) if p.is_running()]


class SpareJoins(logging.Handler):
    """Counts the driver's "a hot spare is standby rank" lines; ``is_set()`` once there was one since the last
    ``clear()``."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "is standby rank" in record.getMessage():
            self.count += 1
            self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()

    def clear(self) -> None:
        self.event.clear()


def spare_joins() -> SpareJoins:
    """A fresh :class:`SpareJoins` on the ``raympi`` logger (the one of an earlier call removed)."""
    handler = SpareJoins()
    logger = logging.getLogger("raympi")
    for old in [h for h in logger.handlers if isinstance(h, SpareJoins)]:
        logger.removeHandler(old)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.disabled = False  # importing ray.train configures logging with disable_existing_loggers
    return handler
