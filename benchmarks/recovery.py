"""Recovery time after a failure: raympi (warm and cold paths) against Ray Train's ``TorchTrainer``.

Recovery time is measured by the benchmark itself, on the wall clock, from the
moment it injects the failure to the first training step completed after it:

    raympi, killed worker     one training Worker process SIGKILLed; one local Ray node (4 CPUs:
                              the 2 workers and, at default settings, a hot spare)
    raympi, stopped worker    the same, SIGSTOPped: a hung rank, found by the driver's heartbeat
    raympi, killed worker,    the killed worker, with grad_transport="gloo": the gloo process group
      gloo gradients          is built again on the new communicator before the first step
    raympi, removed node      ray.cluster_utils.Cluster: a 0-CPU head and three 1-CPU nodes;
                              the node hosting one of the two workers is removed
                              (Cluster.remove_node); the hot spare on the third node takes over
    Ray Train, killed worker  one RayTrainWorker process SIGKILLed; one local Ray node (4 CPUs),
                              TorchTrainer + FailureConfig(max_failures=1), Ray Train's defaults

Every raympi run uses fit's default settings (spares, transport, deadlines).  raympi's paths:
"warm" is raympi as it ships (the survivors keep their state, only failed ranks are replaced,
by the hot spare when there is one; cold when that cannot apply), "cold" disables the
warm attempt in the driver (``raympi.driver.recovery.warm`` patched to raise
``WarmSkipped``) so the group is
killed, re-formed and restored from the newest checkpoint.  The table splits raympi's recovery
into detection (injection -> the driver's restart record), re-formation (``reform_s``) and the
first step after it (``first_step_s``), and counts the restarts a hot spare served.  A raympi without a
warm path is reported as such, not measured.

Both frameworks train the same model (784-256-10 MLP on random MNIST-shaped data
of a fixed seed, Adam 1e-3) with 2 workers on CPU, 1 torch thread each, global
batch 64, a checkpoint every 20 steps.  The model sleeps PACE_S per forward so the
runs go at a known pace and the failure lands mid-run on any machine.  The failure
is injected once the checkpoint of step 40 exists (raympi: its folder appears, and the run is
in its steady state: its hot spare has joined the standby communicator;
Ray Train: its controller has registered it, which it does lazily, some 20 steps
later, so Ray Train restores step 40 rather than step 20). A raympi run ends 50 steps after the
step it resumed from (a callback asks it to stop): what is measured is over by then.

raympi: "the first step after" is the first record of ``Result.metrics``
received after the injection whose step is past the restored one; the table also
shows raympi's own ``recovery_s`` (failure *noticed* by the driver -> first step)
and ``steps_lost`` (steps the driver had received and has to redo).  Ray Train:
the training loop appends (time, step, pid, rank) to a file after each step; the
first step after is the first line written after the injection by a process that
had not written before it (a restarted worker); steps lost = last step written
before the injection - the step training resumed from.  Only processes of the
benchmark's own Ray instance are ever signalled.

The scenarios run interleaved (A B C ..., A B C ..., ...); each starts and stops
its own Ray instance.  A run with more failures than the injected one (another
process killed a worker) is shown and excluded from the stats.  The table gives
median/min/max and the ratio Ray Train / raympi of the medians;
benchmarks/out/recovery.csv has every run, recovery_summary.csv the table
(recovery_quick*.csv with --quick).

Run:
    python benchmarks/recovery.py              # 3 runs of each of 6 scenarios: about 12-15 minutes on 2 cores
    python benchmarks/recovery.py --runs 5
    python benchmarks/recovery.py --runs 7 --only "killed worker (warm)"
    python benchmarks/recovery.py --runs 5 --only "(warm),Ray Train"   # raympi as it ships against Ray Train
    python benchmarks/recovery.py --quick      # 1 run, raympi killed worker (default path) only, small data (tests)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")

import psutil  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, where this file is imported rather than run

import raympi  # noqa: E402
from _common import (  # noqa: E402
    OMP1,
    OUT,
    one_cpu_nodes,
    own_raylets,
    spare_joins,
    ray_processes,
    raylet_pids,
    start_local_ray,
    training_workers,
    write_csv,
)

if __name__ != "__main__":  # imported: the model and the train loop must still reach the workers by value
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

PACE_S = 0.005  # sleep per forward pass, in both frameworks
BATCH = 64
WORKERS = 2
CHECKPOINT_EVERY = 20
FAIL_AFTER_CHECKPOINT = 40  # inject the failure once the checkpoint of this step exists
AFTER_RECOVERY = 50  # raympi runs end this many steps past the step a recovery resumed from
SEED = 0

RAYTRAIN_KILL = "Ray Train killed worker"


class PacedMLP(nn.Sequential):
    """784-256-10; defined in this script so Ray pickles it by value (workers cannot import benchmarks/)."""

    def forward(self, x):
        time.sleep(PACE_S)
        return super().forward(x)


def make_model() -> nn.Module:
    torch.manual_seed(SEED)
    return PacedMLP(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))


def make_data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    return torch.randn(n, 784, generator=g), torch.randint(0, 10, (n,), generator=g)


def _wait_for(predicate: Callable[[], bool], timeout: float, stop: threading.Event) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop.is_set():
        if predicate():
            return True
        time.sleep(0.01)
    return False


class _Injector:
    """A thread that waits for ``ready()`` and then runs ``inject()``, noting the wall-clock time just
    before (or the time ``inject()`` returns: when it fired, after finding its victim)."""

    def __init__(
        self, ready: Callable[[], bool], inject: Callable[[], Optional[float]], timeout: float = 180.0
    ) -> None:
        self.time: Optional[float] = None
        self.error: Optional[str] = None
        self.stop = threading.Event()

        def run() -> None:
            if not _wait_for(ready, timeout, self.stop):
                self.error = "the failure was never injected (the run ended or stalled before the checkpoint)"
                return
            try:
                before = time.time()
                fired = inject()  # the time it fired, when finding the victim took a while
                self.time = fired if fired is not None else before
            except Exception as exc:  # reported with the run
                self.error = f"injecting the failure raised {type(exc).__name__}: {exc}"

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.stop.set()
        self.thread.join(60)


# ---------------------------------------------------------------- raympi


# Restart records of planned stops, not failures (their "kind" is a raympi.driver.policy.FailureKind value):
# SIGTERM to a worker, capacity back (regroup), a replacement taken into a running group (grow).
PLANNED_KINDS = ("preempted", "capacity_back", "replacement_ready", "degraded")
# A lost worker or node: the actor's death, or the survivors' collective failing first.
LOST_KINDS = ("worker_lost", "collective")


def _recovery_module() -> Any:
    """``raympi.driver.recovery`` (imported here: it imports Ray), whose ``warm`` the controller calls."""
    import importlib

    return importlib.import_module("raympi.driver.recovery")


def has_warm_path() -> bool:
    """Whether this raympi tries a warm restart before the cold one (``raympi.driver.recovery.warm``)."""
    return hasattr(_recovery_module(), "warm")


class _StopAfterRecovery:
    """A fit callback that ends the run AFTER_RECOVERY steps past a recovery: what is measured is over by
    then, and a run that went on would only take time (after a removed node, minutes: see the README)."""

    def __init__(self) -> None:
        self.resumed_at: Optional[int] = None

    def on_restart(self, record: dict[str, Any]) -> None:
        if record["kind"] not in PLANNED_KINDS and self.resumed_at is None:
            self.resumed_at = record["restored_step"]

    def on_step(self, record: dict[str, Any]) -> bool:
        return self.resumed_at is not None and record["step"] >= self.resumed_at + AFTER_RECOVERY


def _raympi_fit(
    folder: str, n: int, steps: int, path: str, transport: str = "mpi", shard: bool = False
) -> raympi.Result:
    """``path``: 'warm' runs raympi as it is (warm first, cold as fallback); 'cold' disables the warm attempt in the
    driver.  ``transport``: fit's ``grad_transport`` (a gloo process group is rebuilt on every new communicator).
    ``shard``: ``shard_optimizer`` (the slices re-cut for the new group, the lost one from its buddy copy)."""
    recovery = _recovery_module()
    saved = getattr(recovery, "warm", None)
    if path == "cold" and saved is not None:

        def declined(*args: Any, **kwargs: Any) -> Any:
            raise recovery.WarmSkipped("forced cold by the benchmark")

        # The controller calls recovery.warm through the module: it takes the cold path, recording warm_skipped.
        recovery.warm = declined
    try:
        return raympi.fit(
            make_model(),
            make_data(n),
            workers=WORKERS,
            batch_size=BATCH,
            epochs=10**6,
            max_steps=steps,
            checkpoint_every=CHECKPOINT_EVERY,
            checkpoint_dir=folder,
            progress=False,
            seed=SEED,
            torch_threads=1,
            optimizer=raympi.optim.adam(1e-3),
            grad_transport=transport,
            shard_optimizer=shard,
            callbacks=[_StopAfterRecovery()],
        )
    finally:
        if path == "cold" and saved is not None:
            recovery.warm = saved


def _raympi_measure(result: raympi.Result, injected: float, path: str) -> dict[str, Any]:
    failures = [r for r in result.restarts if r["kind"] not in PLANNED_KINDS]
    if not failures:
        raise RuntimeError("raympi did not restart: the failure landed after the run ended")
    notes = []
    if len(failures) > 1:
        notes.append(
            f"{len(failures)} failures, not 1 ({'; '.join(r['cause'][:80] for r in failures[1:])}): "
            "excluded from the stats"
        )
    expected = path
    if failures[0].get("path", "cold") != expected:
        why = failures[0].get("warm_error") or failures[0].get("warm_skipped")
        notes.append(f"path {failures[0].get('path', 'cold')}, not {expected}" + (f" ({why[:120]})" if why else ""))
    for r in result.restarts:
        if r["kind"] == "degraded":  # the warm group ran far slower: replaced (checkpoint, fresh group)
            notes.append(
                f"then {r['cause']}: a fresh group from step {r['restored_step']} "
                f"took {r.get('recovery_s') or 0:.1f} s more"
            )
    note = "; ".join(notes)
    record = failures[0]
    after = [m for m in result.metrics if m["time"] > injected and m["step"] > record["restored_step"]]
    if not after:
        raise RuntimeError("no step completed after the failure")
    return {
        "recovery_s": after[0]["time"] - injected,
        "reported_recovery_s": record.get("recovery_s"),
        "steps_lost": record["steps_lost"],
        "restored_step": record["restored_step"],
        "kind": record["kind"],
        "world_before": record["world_before"],
        "world_after": record["world_after"],
        "restarts": len(failures),
        "path": record.get("path", "cold"),
        "note": note,
        "spare": record.get("spare"),
        "reformed": record.get("reformed"),
        "detect_s": record["time"] - injected,
        "reform_s": record.get("reform_s"),
        "first_step_s": record.get("first_step_s"),
    }


def _checkpoint_exists(folder: str) -> Callable[[], bool]:
    """Ready to inject: the checkpoint exists and the run is in its steady state (its hot spare has
    joined the standby communicator, as it has in any run past its first seconds)."""
    path = Path(folder) / f"step-{FAIL_AFTER_CHECKPOINT:08d}"
    joined = spare_joins()
    return lambda: (
        joined.is_set()
        and (
            path.exists() or any(p.name > path.name for p in path.parent.glob("step-*"))  # older ones are rotated out
        )
    )


def raympi_killed_worker(
    n: int, steps: int, path: str, sig: int = signal.SIGKILL, transport: str = "mpi", shard: bool = False
) -> dict[str, Any]:
    """One training worker signalled: SIGKILL (it dies) or SIGSTOP (it hangs; it is SIGCONT'ed by its killing).
    ``transport``: the gradients' data plane (``grad_transport``)."""
    import ray

    folder = tempfile.mkdtemp(prefix="raympi-bench-")
    injector = None
    try:
        start_local_ray(4, env=OMP1, log_to_driver=False)  # as raympi.fit starts Ray itself
        raylets = own_raylets()

        def inject() -> float:
            victim = training_workers(raylets)[-1]  # watches for 0.3 s: not part of the recovery
            fired = time.time()
            os.kill(victim.pid, sig)
            return fired

        injector = _Injector(_checkpoint_exists(folder), inject)
        result = _raympi_fit(folder, n, steps, path, transport, shard)
        injector.join()
        if injector.time is None:
            raise RuntimeError(injector.error)
        return _raympi_measure(result, injector.time, path)
    finally:
        if injector is not None:
            injector.join()
        ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


def _node_of(process: psutil.Process, nodes: list[Any]) -> Optional[Any]:
    """The Cluster node whose raylet is an ancestor of ``process``."""
    raylets = {pid: node for node in nodes for pid in raylet_pids([node])}
    try:
        for parent in process.parents():
            if parent.pid in raylets:
                return raylets[parent.pid]
    except psutil.Error:
        pass
    return None


def raympi_removed_node(n: int, steps: int, path: str) -> dict[str, Any]:
    folder = tempfile.mkdtemp(prefix="raympi-bench-")
    try:
        with one_cpu_nodes(WORKERS + 1) as cluster:
            removed: list[str] = []

            def remove() -> float:
                nodes = list(cluster.worker_nodes)
                training = training_workers(raylet_pids(nodes))  # not the idle hot spare's node
                hosting = [h for h in (_node_of(p, nodes) for p in training) if h is not None]
                if not hosting:
                    raise RuntimeError("found no node hosting a training raympi worker")
                removed.append(hosting[-1].node_id)
                fired = time.time()
                cluster.remove_node(hosting[-1])
                return fired

            injector = _Injector(_checkpoint_exists(folder), remove)
            try:
                result = _raympi_fit(folder, n, steps, path)
            finally:
                injector.join()
        if injector.time is None:
            raise RuntimeError(injector.error)
        out = _raympi_measure(result, injector.time, path)
        if out["kind"] not in LOST_KINDS:
            raise RuntimeError(f"expected a {' or '.join(LOST_KINDS)} restart, got {out['kind']}")
        return out
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------- Ray Train


def _train_loop(config: dict[str, Any]) -> None:
    """The Ray Train loop: DDP over gloo, a checkpoint every CHECKPOINT_EVERY steps, one log line per step."""
    import ray.train
    import ray.train.torch

    torch.set_num_threads(1)
    rank, world = ray.train.get_context().get_world_rank(), ray.train.get_context().get_world_size()
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            saved = torch.load(os.path.join(d, "state.pt"))
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        start = saved["step"]
    model = ray.train.torch.prepare_model(model)
    x, y = make_data(config["n"])
    spe = len(x) // BATCH
    order, order_epoch = None, -1
    log = open(config["log"], "a", buffering=1)
    for step in range(start, config["steps"]):
        epoch, i = divmod(step, spe)
        if epoch != order_epoch:
            order, order_epoch = torch.randperm(len(x), generator=torch.Generator().manual_seed(SEED + epoch)), epoch
        idx = order[i * BATCH : (i + 1) * BATCH][rank::world]
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.write(f"{time.time()!r} {step + 1} {os.getpid()} {rank}\n")
        if (step + 1) % CHECKPOINT_EVERY == 0:
            with tempfile.TemporaryDirectory() as d:
                saved = None
                if rank == 0:
                    torch.save(
                        {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1},
                        os.path.join(d, "state.pt"),
                    )
                    saved = ray.train.Checkpoint.from_directory(d)
                ray.train.report({"loss": loss.item(), "step": step + 1}, checkpoint=saved)
    log.close()


def _read_log(path: str) -> list[tuple[float, int, int, int]]:
    rows = []
    try:
        text = Path(path).read_text()
    except OSError:
        return rows
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4:  # a line being written may be partial
            rows.append((float(parts[0]), int(parts[1]), int(parts[2]), int(parts[3])))
    return rows


def raytrain_killed_worker(n: int, steps: int) -> dict[str, Any]:
    import ray
    import ray.train
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    folder = tempfile.mkdtemp(prefix="raytrain-bench-")
    log = os.path.join(folder, "steps.log")
    injector = None
    try:
        # With the dashboard (ray.init's default): Ray Train's PlacementGroupCleaner watches the controller through
        # the state API; without it, it was seen to remove the placement group under a run that had just finished.
        start_local_ray(4, env=OMP1, log_to_driver=False, dashboard=None)
        raylets = own_raylets()
        snapshot = Path(folder, "storage", "bench", "checkpoint_manager_snapshot.json")
        registered = re.compile(rf'"step":\s*{FAIL_AFTER_CHECKPOINT}\b')

        def ready() -> bool:  # the controller registered the checkpoint of FAIL_AFTER_CHECKPOINT (it restores from it)
            try:
                return bool(registered.search(snapshot.read_text()))
            except OSError:
                return False

        def kill() -> float:
            rank1 = {pid for _, _, pid, rank in _read_log(log) if rank == 1}
            victims = [p for p in ray_processes("ray::RayTrainWorker", raylets) if p.pid in rank1]
            if not victims:
                raise RuntimeError("found no RayTrainWorker process of rank 1")
            fired = time.time()
            os.kill(victims[0].pid, signal.SIGKILL)
            return fired

        injector = _Injector(ready, kill)
        trainer = TorchTrainer(
            _train_loop,
            train_loop_config={"n": n, "steps": steps, "log": log},
            scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False),
            run_config=RunConfig(
                name="bench", storage_path=os.path.join(folder, "storage"), failure_config=FailureConfig(max_failures=1)
            ),
        )
        error = None
        try:
            trainer.fit()
        except Exception as exc:  # measured all the same when it came after the recovery, and noted
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        injector.join()
        if injector.time is None:
            raise RuntimeError(injector.error)
        injected = injector.time
        rows = _read_log(log)
        before = [r for r in rows if r[0] <= injected]
        old_pids = {r[2] for r in before}
        after = [r for r in rows if r[0] > injected and r[2] not in old_pids]
        if not after:
            raise RuntimeError(
                f"Ray Train did not restart: no step from a new worker after the failure ({error or 'fit() returned'})"
            )
        first = after[0]
        restored = first[1] - 1
        return {
            "recovery_s": first[0] - injected,
            "reported_recovery_s": None,
            "steps_lost": max(r[1] for r in before) - restored,
            "restored_step": restored,
            "kind": "SIGKILL",
            "world_before": WORKERS,
            "world_after": len({r[3] for r in after}),
            "restarts": 1,
            "path": "restart",
            "note": f"recovered, then fit() raised {error}" if error else "",
        }
    finally:
        if injector is not None:
            injector.join()
        ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------- driver


def _fmt(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each scenario (median/min/max over them)")
    parser.add_argument(
        "--quick", action="store_true", help="1 run, raympi killed worker (default path) only, small data"
    )
    parser.add_argument(
        "--only",
        default="",
        help="run only the scenarios whose name contains this text (or one of several, comma-separated), "
        "e.g. 'killed worker (warm)' or '(warm),Ray Train'",
    )
    args = parser.parse_args(argv)
    runs = 1 if args.quick else max(1, args.runs)
    n, raympi_steps, raytrain_steps = (2048, 400, 0) if args.quick else (8192, 1500, 120)
    paths = ["warm", "cold"] if has_warm_path() else ["cold"]
    scenarios: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    for path in paths[:1] if args.quick else paths:
        scenarios.append(
            (f"raympi killed worker ({path})", lambda path=path: raympi_killed_worker(n, raympi_steps, path))
        )
    raytrain_note = ""
    if not args.quick:
        scenarios.append(
            ("raympi stopped worker (warm)", lambda: raympi_killed_worker(n, raympi_steps, "warm", signal.SIGSTOP))
        )
        scenarios.append(
            (
                "raympi killed worker, sharded optimizer (warm)",
                lambda: raympi_killed_worker(n, raympi_steps, "warm", shard=True),
            )
        )
        scenarios.append(
            (
                "raympi killed worker, gloo (warm)",
                lambda: raympi_killed_worker(n, raympi_steps, "warm", signal.SIGKILL, "gloo"),
            )
        )
        for path in paths:
            scenarios.append(
                (f"raympi removed node ({path})", lambda path=path: raympi_removed_node(n, raympi_steps, path))
            )
        try:
            import ray.train.torch  # noqa: F401
            from ray.train.v2._internal.constants import is_v2_enabled

            raytrain_note = f"Ray Train {'v2' if is_v2_enabled() else 'v1'} API"
            scenarios.append((RAYTRAIN_KILL, lambda: raytrain_killed_worker(n, raytrain_steps)))
        except ImportError as exc:
            raytrain_note = f"Ray Train not measured: {exc}"

    if args.only:
        wanted = [text.strip() for text in args.only.split(",")]
        scenarios = [(name, run) for name, run in scenarios if any(text in name for text in wanted)]
        if not scenarios:
            parser.error(f"no scenario name contains {args.only!r}")

    import ray

    print(
        f"raympi recovery benchmark: ray {ray.__version__}, torch {torch.__version__}, {psutil.cpu_count()} CPUs, "
        f"{runs} run(s) per scenario; {raytrain_note or 'Ray Train not run (--quick)'}",
        flush=True,
    )
    print(
        f"model 784-256-10 MLP (+{PACE_S * 1000:g} ms sleep per forward), {WORKERS} workers, batch {BATCH}, "
        f"checkpoint every {CHECKPOINT_EVERY} steps, "
        f"failure injected after the checkpoint of step {FAIL_AFTER_CHECKPOINT}",
        flush=True,
    )

    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in scenarios}
    errors: dict[str, list[str]] = {name: [] for name, _ in scenarios}
    for run in range(runs):
        for name, scenario in scenarios:
            started = time.monotonic()
            try:
                out = scenario()
            except Exception as exc:
                errors[name].append(f"{type(exc).__name__}: {exc}")
                print(f"  run {run + 1} {name}: FAILED {type(exc).__name__}: {exc}", flush=True)
                traceback.print_exc(file=sys.stderr)
                continue
            out["run"] = run + 1
            out["excluded"] = "excluded" in out.get("note", "")
            results[name].append(out)
            print(
                f"  run {run + 1} {name}: {out['recovery_s']:.2f} s to the first step after the failure, "
                f"{out['steps_lost']} step(s) lost (scenario took {time.monotonic() - started:.0f} s)"
                + (f" [{out['note']}]" if out.get("note") else ""),
                flush=True,
            )

    def median(name: str, key: str = "recovery_s") -> Optional[float]:
        values = [r[key] for r in results.get(name, []) if r.get(key) is not None and not r["excluded"]]
        return statistics.median(values) if values else None

    raytrain = median(RAYTRAIN_KILL)
    header = (
        f"{'scenario':<34} | {'median s':>8} | {'min s':>6} | {'max s':>6} | {'runs':>4} | {'steps lost':>10} | "
        f"{'detect s':>8} | {'reform s':>8} | {'1st step s':>10} | {'spare':>5} | {'Ray Train/raympi':>16}"
    )
    print()
    print(header)
    print("-" * len(header))
    summary = []
    for name, _ in scenarios:
        values = [r["recovery_s"] for r in results[name] if not r["excluded"]]
        if not values:
            print(f"{name:<34} | {'failed':>8} |")
            continue
        med = statistics.median(values)
        ratio = raytrain / med if raytrain is not None and name != RAYTRAIN_KILL else None
        lost = median(name, "steps_lost")
        split = {key: median(name, key) for key in ("detect_s", "reform_s", "first_step_s")}
        spares = [r.get("spare") for r in results[name] if not r["excluded"] and r.get("spare") is not None]
        spare = f"{sum(spares)}/{len(spares)}" if spares else "-"
        print(
            f"{name:<34} | {med:>8.2f} | {min(values):>6.2f} | {max(values):>6.2f} | {len(values):>4} | "
            f"{_fmt(lost, 0):>10} | {_fmt(split['detect_s']):>8} | {_fmt(split['reform_s']):>8} | "
            f"{_fmt(split['first_step_s']):>10} | {spare:>5} | {(_fmt(ratio, 1) + 'x') if ratio else '-':>16}"
        )
        summary.append(
            {
                "scenario": name,
                "median_s": med,
                "min_s": min(values),
                "max_s": max(values),
                "runs": len(values),
                "steps_lost_median": lost,
                **{f"{k}_median": v for k, v in split.items()},
                "spares_used": spare,
                "raytrain_over_raympi": ratio,
            }
        )
    if raytrain is not None:
        rows = [(r["scenario"], r["raytrain_over_raympi"]) for r in summary if r["raytrain_over_raympi"]]
        print(
            "goal: the killed worker >= 20x faster than Ray Train: "
            + ", ".join(f"{name} {ratio:.1f}x" for name, ratio in rows if "killed worker (warm)" in name)
        )
    targets = (
        ("raympi killed worker (warm)", 0.3),
        ("raympi removed node (warm)", 0.5),
        ("raympi stopped worker (warm)", 1.0),  # replaced at once, labelled (died or hung) after
    )
    for name, target in targets:
        med = median(name)
        if med is not None:
            print(f"target: {name} <= {target} s: median {med:.2f} s, {'met' if med <= target else 'NOT met'}")
    reformed = {name: [r.get("reformed") for r in results[name]] for name, _ in scenarios if name.startswith("raympi")}
    for name, how in reformed.items():
        if any(how):
            print(f"{name}: re-formed by derivation from the standby communicator {how.count('derived')}/{len(how)}")
    if "warm" not in paths:
        for what in ("killed worker", "removed node"):
            print(f"{'raympi ' + what + ' (warm)':<34} | warm: not implemented (raympi has only the cold path)")
    if raytrain is None and not args.quick:
        print("Ray Train: no measurement (see the errors above)")
    for name, _ in scenarios:
        if name.endswith("(warm)") and results[name]:
            taken = [r["path"] for r in results[name]]
            print(
                f"{name}: path taken warm {taken.count('warm')}/{len(taken)}, "
                f"cold fallback {taken.count('cold')}/{len(taken)}"
            )
    for name, _ in scenarios:
        excluded = [r["run"] for r in results[name] if r["excluded"]]
        if excluded or errors[name]:
            print(
                f"{name}: {len(errors[name])} run(s) failed, run(s) {excluded or '-'} excluded "
                "(more than the one injected failure)"
            )

    stem = (
        "recovery_quick" if args.quick else ("recovery_only" if args.only else "recovery")
    )  # a partial run leaves the full results alone
    fields = [
        "scenario",
        "run",
        "recovery_s",
        "reported_recovery_s",
        "detect_s",
        "reform_s",
        "first_step_s",
        "spare",
        "reformed",
        "steps_lost",
        "restored_step",
        "kind",
        "path",
        "world_before",
        "world_after",
        "restarts",
        "excluded",
        "note",
    ]
    write_csv(
        OUT / f"{stem}.csv",
        ({"scenario": name, **r} for name, _ in scenarios for r in results[name]),
        fields,
        extrasaction="ignore",
    )
    write_csv(OUT / f"{stem}_summary.csv", summary, list(summary[0]) if summary else ["scenario"])
    print(f"\nwrote {OUT / (stem + '.csv')} and {OUT / (stem + '_summary.csv')}")
    return 0 if all(any(not r["excluded"] for r in results[name]) for name, _ in scenarios) else 1


if __name__ == "__main__":
    sys.exit(main())
