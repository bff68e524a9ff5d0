"""Throughput with one of 2 ranks slowed 3x: raympi evicting the straggler for a hot spare, raympi keeping it,
and torchrun + DDP, side by side in one run.

The slowdown is real and the same for every contender: once the run is warm (step ``--slow-from``, and for raympi
its hot spare inside the standby communicator), a separate process stops one training rank's process and lets it
run in turn (SIGSTOP for 100 ms, SIGCONT for 50 ms: a third of the time running, its compute 3x as long, as on a
throttled node), until the process is gone or the run ends.  The contenders:

    raympi                          un-slowed: the reference of the raympi rows
    raympi slowed, eviction on      one rank slowed; ``straggler_factor`` / ``straggler_chunks`` as ``--factor`` /
                                    ``--chunks``: the hot spare on the third node takes its place (warm, no step lost)
    raympi slowed, eviction off     one rank slowed, ``straggler_factor=None``: it stays
    torchrun + DDP                  un-slowed, gloo, 2 processes: the reference of the DDP rows
    torchrun + DDP slowed           one rank slowed the same way
    raympi slowed, eviction on,     with --diagnose: the eviction run, but raympi starts no new hot spare after the
      no new spare                  eviction (patched in the driver, as a diagnosis: what that start costs here)

raympi runs on a ``ray.cluster_utils.Cluster`` of a 0-CPU head (the driver) and three 1-CPU nodes (2 ranks, the
hot spare on the third: a straggler is only evicted for a spare on another node); the cluster is shut down before
the DDP runs.  Every contender trains the same MLP 784-1024-1024-10 (1.9M parameters) with SGD 0.01 on the same
random MNIST-shaped data, global batch 512 (256 per rank), 1 torch thread per process, for ``--steps`` steps.

Measured: samples/s over the steady tail (the last third of the steps, from the end of the first raympi chunk in
it; DDP: rank 0's time after each step), its ratio to the same framework's un-slowed run of the same invocation, and
to the run's own pace before the slowdown (the second half of the steps before it: a reference minutes closer than
the other run's).  For the eviction, from the run's ``ranks.jsonl`` (each chunk's compute per rank),
``metrics.jsonl`` (each chunk's samples/s; after a restart they count from the new group's start) and the
``straggler`` restart record: the chunk whose completion found the straggler (the detection: the one before the
chunk that drained), the chunks after it until one is back at >= 0.9 of the un-slowed raympi (the target: within 2),
the restart's seconds, and the tail after it.  A trace of the chunks around the eviction is printed, each with the
compute per step of each rank, other jobs' load on the machine meanwhile (``/proc/stat`` less this process tree)
and the CPU of the raylets' processes other than the ranks (the hot spare raympi starts after an eviction, on this
same machine).  The slowed rank's compute per step against its peer's, over the slowed chunks, is what the rule saw.

Only ratios within one invocation mean anything on a shared 2-core machine: the table's last column is the other
jobs' load during each contender.  benchmarks/out/stragglers.csv has every run's figures, stragglers_chunks.csv the
eviction runs' chunks (``stragglers_quick*`` with --quick, ``stragglers_only*`` with --only).

Run:
    python benchmarks/stragglers.py                 # one run of the five, ~2-3 minutes on 2 quiet cores
    python benchmarks/stragglers.py --runs 3        # medians of 3 (min-max)
    python benchmarks/stragglers.py --only "raympi" # the raympi rows alone ("DDP" for torchrun's)
    python benchmarks/stragglers.py --diagnose      # and the eviction with no new hot spare started after it
    python benchmarks/stragglers.py --quick         # a smoke run whose figures mean nothing
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, where this file is imported rather than run

from _common import (  # noqa: E402
    CHUNK_GAP_S,
    OMP1,
    OUT,
    SEED,
    add_child_options,
    ddp,
    fmt,
    ray_processes,
    raylet_pids,
    read_spec,
    rotated,
    run_torchrun,
    spare_joins,
    steady_samples_per_s,
    torchrun_gloo,
    training_workers,
    write_csv,
    write_spec,
)

WORKERS = 2
BATCH = 512  # global: 256 samples per rank
HIDDEN = 1024
N = 16384  # samples: 32 steps an epoch
LR = 0.01
STOP_S, RUN_S = 0.1, 0.05  # the duty cycle: stopped 2/3 of the time, compute 3x as long
TARGET_RATIO, TARGET_CHUNKS = 0.9, 2  # back at >= 0.9 of the un-slowed throughput within 2 chunks of the detection
TAIL_SHARE = 3  # the steady tail: the last 1/TAIL_SHARE of the steps

REF, EVICT, KEEP = "raympi", "raympi slowed, eviction on", "raympi slowed, eviction off"
NO_REFILL = "raympi slowed, eviction on, no new spare"  # --diagnose: what the new hot spare's start costs
EVICTING = (EVICT, NO_REFILL)
DDP_REF, DDP_SLOW = "torchrun + DDP", "torchrun + DDP slowed"
RAYMPI = (REF, EVICT, KEEP, NO_REFILL)
DDPS = (DDP_REF, DDP_SLOW)


def make_model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(784, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10))


def make_data(n: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(SEED)
    return torch.randn(n, 784, generator=g), torch.randint(0, 10, (n,), generator=g)


# ---------------------------------------------------------------- the slowdown


def duty_cycle(pid: int) -> None:
    """Stop ``pid`` for STOP_S and let it run for RUN_S, over and over, until it is gone or this process gets
    SIGTERM; it is left running (SIGCONT) either way.  Runs in a process of its own (``--duty PID``)."""

    def end(*_: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, end)
    try:
        while True:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(STOP_S)
            os.kill(pid, signal.SIGCONT)
            time.sleep(RUN_S)
    except ProcessLookupError:  # gone: evicted, or the run ended
        return
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


class Slowdown:
    """Starts :func:`duty_cycle` on a process (in a process of its own) once ``ready()``, from a thread; noting the
    wall time it started and the victim's pid.  ``victim()`` finds the process to slow."""

    def __init__(self, ready: Callable[[], bool], victim: Callable[[], int], timeout_s: float = 300.0) -> None:
        self.started: Optional[float] = None
        self.pid: Optional[int] = None
        self.error: Optional[str] = None
        self.proc: Optional[subprocess.Popen] = None
        self.done = threading.Event()

        def run() -> None:
            deadline = time.monotonic() + timeout_s
            while not ready():
                if self.done.is_set() or time.monotonic() > deadline:
                    self.error = "the slowdown never started (the run ended before it was warm)"
                    return
                time.sleep(0.01)
            try:
                self.pid = victim()
                self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--duty", str(self.pid)])
                self.started = time.time()
            except Exception as exc:  # reported with the run
                self.error = f"starting the slowdown raised {type(exc).__name__}: {exc}"

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """End the duty cycle (its process lets the victim run again) and the thread."""
        self.done.set()
        self.thread.join(30)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # our own child: it sends SIGCONT on its way out
            self.proc.wait(10)


class Load:
    """A thread that samples, every ``period_s``, the machine's busy CPU (``/proc/stat``) less this process tree's
    (this process and its descendants: the Ray cluster, torchrun, the ranks): other jobs' load, in cores.  The
    machine is shared; a contender measured under more of it is slower for that alone.  With ``raylets``: also the
    CPU each Ray process of theirs used, with its start time (a hot spare started after an eviction)."""

    def __init__(self, raylets: Optional[set[int]] = None, period_s: float = 0.25) -> None:
        import psutil

        self.samples: list[tuple[float, float]] = []  # (wall time, other jobs' cores since the previous sample)
        self.ray: dict[int, list[tuple[float, float, str]]] = {}  # pid: [(wall time, CPU s, title)]
        self.done = threading.Event()
        me = psutil.Process()

        def busy() -> float:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
            return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle, iowait

        def ours() -> dict[int, float]:
            cpu = {}
            for proc in [me, *me.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    t = proc.cpu_times()
                    cpu[proc.pid] = t.user + t.system
            return cpu

        def used(before: dict[int, float], after: dict[int, float]) -> float:
            # Process by process: one that ends takes its CPU with it (a reaped child's time lands in its parent's
            # children_* all at once), which would read as others' load; one that started used all it has.
            return sum(max(0.0, cpu - before.get(pid, 0.0)) for pid, cpu in after.items())

        def ray_cpu(now: float) -> None:
            for proc in ray_processes("", raylets or set()):  # a worker process still starting is no ray:: yet
                with contextlib.suppress(psutil.Error):
                    t = proc.cpu_times()
                    self.ray.setdefault(proc.pid, []).append((now, t.user + t.system, proc.info["cmdline"][0]))

        def run() -> None:
            last = (time.monotonic(), busy(), ours())
            while not self.done.wait(period_s):
                now = (time.monotonic(), busy(), ours())
                other = max(0.0, (now[1] - last[1]) - used(last[2], now[2])) / (now[0] - last[0])
                self.samples.append((time.time(), other))
                last = now
                if raylets:
                    ray_cpu(time.time())

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def stop(self) -> Optional[float]:
        """Stop sampling; the mean of other jobs' load, in cores (None: no sample)."""
        self.done.set()
        self.thread.join(5)
        return self.other(0.0, float("inf"))

    def other(self, start: float, end: float) -> Optional[float]:
        """Other jobs' mean load between the wall times ``start`` and ``end``, in cores."""
        inside = [cores for t, cores in self.samples if start < t <= end]
        return statistics.mean(inside) if inside else None

    def spare_cpu(self, start: float, end: float) -> float:
        """CPU seconds that the raylets' processes which never ran steps (all but the ranks, evicted ones included:
        a hot spare starting, idle workers, Ray's agents) used between ``start`` and ``end``."""
        total = 0.0
        for samples in self.ray.values():
            if any(title.startswith("ray::Worker.run") for _, _, title in samples):
                continue  # a rank
            inside = [c for t, c, _ in samples if start <= t <= end]
            before = [c for t, c, _ in samples if t < start]
            if inside:
                total += inside[-1] - (before[-1] if before else inside[0])
        return total


# ---------------------------------------------------------------- raympi


class _Step:
    """A fit callback: the newest step the driver has seen."""

    def __init__(self) -> None:
        self.step = 0

    def on_step(self, record: dict[str, Any]) -> None:
        self.step = record["step"]


class _Log(logging.Handler):
    """The driver's log lines about hot spares, with their wall time: when the new spare started and joined."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "spare" in text or "straggler" in text or "slower" in text:
            self.lines.append((record.created, text))


@contextlib.contextmanager
def cluster_of(nodes: int) -> Any:
    """A ``ray.cluster_utils.Cluster``: a 0-CPU head (the driver) and ``nodes`` 1-CPU nodes, Ray attached to it
    (workers with OMP_NUM_THREADS=1, their logs not relayed); shut down after the block."""
    import ray
    from ray.cluster_utils import Cluster

    # No dashboard, no fixed port (a head's default: 8265 for the dashboard, 52365 for its agent).
    head = {"num_cpus": 0, "include_dashboard": False, "dashboard_port": None, "dashboard_agent_listen_port": 0}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        for _ in range(nodes):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(
            address=cluster.address,
            logging_level="ERROR",
            log_to_driver=False,
            runtime_env={"env_vars": dict(OMP1)},
        )
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def raympi_run(
    cluster: Any, name: str, steps: int, slow_from: int, factor: Optional[float], chunks: int
) -> dict[str, Any]:
    """One ``raympi.fit`` on ``cluster``: slowed from ``slow_from`` (once the hot spare has joined) unless ``name``
    is the reference; the eviction rule ``factor`` (None: off) over ``chunks`` chunks.  ``NO_REFILL``: raympi starts
    no new hot spare once the straggler is found (``WorkerGroup._start_spare`` patched in this driver)."""
    import raympi
    from raympi.driver import group

    folder = tempfile.mkdtemp(prefix="raympi-stragglers-")
    joined, seen, log = spare_joins(), _Step(), _Log()
    logging.getLogger("raympi").addHandler(log)
    slow = name != REF
    raylets = raylet_pids(list(cluster.worker_nodes))
    # The reference is marked at the same moment, without a slowdown, for the same bookkeeping.
    warm = {"step": None, "time": None}

    def ready() -> bool:
        if seen.step >= slow_from and joined.is_set():
            warm["step"], warm["time"] = seen.step, time.time()
            return True
        return False

    slowdown = Slowdown(ready, lambda: training_workers(raylets)[-1].pid) if slow else None
    start_spare = group.WorkerGroup._start_spare
    if name == NO_REFILL:

        def no_refill(self: Any, bundle_index: Optional[int]) -> None:
            if not any("straggler" in text for _, text in log.lines):
                start_spare(self, bundle_index)

        group.WorkerGroup._start_spare = no_refill
    marker = None if slow else threading.Thread(target=lambda: _wait(ready), daemon=True)
    if marker is not None:
        marker.start()
    try:
        result = raympi.fit(
            make_model(),
            make_data(N),
            workers=WORKERS,
            batch_size=BATCH,
            epochs=-(-steps // (N // BATCH)),
            max_steps=steps,
            optimizer=raympi.optim.sgd(LR),
            progress=False,
            seed=SEED,
            torch_threads=1,
            checkpoint_dir=folder,
            checkpoint_every=0,
            keep_workers=False,
            straggler_factor=None if name == KEEP else factor,
            straggler_chunks=chunks,
            callbacks=[seen],
        )
        if slowdown is not None:
            slowdown.stop()
            if slowdown.started is None:
                raise RuntimeError(slowdown.error)
        lines = [json.loads(line) for line in Path(folder, "ranks.jsonl").read_text().splitlines()]
        tail_from = steps - steps // TAIL_SHARE
        out = {
            "samples_per_s": steady_samples_per_s(result.metrics, steps, tail_from, BATCH),
            "slowed_from_step": warm["step"],
            "restarts": [r["kind"] for r in result.restarts],
            "metrics": result.metrics,
            "lines": lines,
            "records": result.restarts,
            "log": log.lines,
            "slow_at": slowdown.started if slowdown is not None else warm["time"],
            "victim": slowdown.pid if slowdown is not None else None,
        }
        out["compute_ratio"] = _compute_ratio(lines, out["slow_at"], result.restarts) if slow else None
        # The pace before the slowdown: the chunks that ended in the second half of the un-slowed steps.
        out["before"] = _rate(result.metrics, slow_from // 2, warm["step"] or 0)
        return out
    finally:
        group.WorkerGroup._start_spare = start_spare
        if slowdown is not None:
            slowdown.stop()
        logging.getLogger("raympi").removeHandler(log)
        shutil.rmtree(folder, ignore_errors=True)


def _rate(metrics: list[dict[str, Any]], lo: int, hi: int) -> Optional[float]:
    """raympi's samples/s from the end of the first chunk that ended at step ``lo`` or later to the end of the last
    that ended at ``hi`` or earlier, by the driver's time stamps (None: fewer than two such chunks)."""
    times = {m["step"]: m["time"] for m in metrics}
    ends = [s for s in sorted(times) if lo <= s <= hi and (s + 1 not in times or times[s + 1] - times[s] > CHUNK_GAP_S)]
    if len(ends) < 2:
        return None
    return BATCH * (ends[-1] - ends[0]) / (times[ends[-1]] - times[ends[0]])


def _wait(predicate: Callable[[], bool], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)


def _per_step_compute(line: dict[str, Any]) -> list[float]:
    return [s / line["steps"] for s in line["compute_s"]]


def _ratio(line: dict[str, Any]) -> float:
    """The slowest rank's compute per step against the median of its peers' (2 ranks: the other one's)."""
    per = _per_step_compute(line)
    r = max(range(len(per)), key=per.__getitem__)
    peers = statistics.median([*per[:r], *per[r + 1 :]])
    return per[r] / max(peers, 1e-9)


def _compute_ratio(lines: list[dict[str, Any]], slow_at: Optional[float], records: list[dict[str, Any]]) -> float:
    """The median over the chunks run wholly while slowed (before any eviction) of :func:`_ratio`."""
    if slow_at is None:
        return float("nan")
    end = min((r["time"] for r in records), default=float("inf"))
    times = [line["time"] for line in lines]
    slowed = [
        _ratio(line)
        for i, line in enumerate(lines)
        if i > 0 and times[i - 1] >= slow_at and line["time"] < end and line["world"] == WORKERS
    ]
    return statistics.median(slowed) if slowed else float("nan")


def eviction(run: dict[str, Any], reference: float, factor: float, chunks: int) -> dict[str, Any]:
    """The eviction of one run (:func:`raympi_run`, eviction on) against the un-slowed samples/s ``reference``:
    the detection chunk, the chunks after it until one is back at >= TARGET_RATIO, the eviction's seconds, and the
    chunk trace (one row per chunk: its index relative to the detection, steps, samples/s as ``metrics.jsonl`` has
    it and by the wall clock between chunk ends, world, compute ms a step per rank)."""
    records = [r for r in run["records"] if r["kind"] == "straggler"]
    per_step = {m["step"]: m for m in run["metrics"]}
    lines = run["lines"]
    if not records:
        return {"evicted": False, "note": f"no eviction (restarts: {run['restarts'] or 'none'})"}
    record = records[0]
    # The detection: a planned stop lets the chunk still in flight finish (two are in flight), so the chunk whose
    # completion found the straggler is the one before the old group's last.  Checked against the rule replayed on
    # ranks.jsonl (the slowest rank's compute per step >= factor x its peer's and 10 ms longer, ``chunks`` in a row).
    before = [i for i, line in enumerate(lines) if line["time"] < record["time"]]
    detected = max(0, before[-1] - 1)
    streak, streaks = 0, []
    for line in lines[: detected + 1]:
        per = _per_step_compute(line)
        streak = streak + 1 if max(per) >= factor * min(per) and max(per) - min(per) >= 0.01 else 0
        streaks.append(streak)
    load = run["load"]
    trace, back = [], None
    for i, line in enumerate(lines):
        wall = BATCH * line["steps"] / (line["time"] - lines[i - 1]["time"]) if i else None
        start = lines[i - 1]["time"] if i else line["time"] - 0.5
        own = per_step.get(line["step"], {}).get("samples_per_s")
        k = i - detected
        if k > 0 and back is None and own is not None and own >= TARGET_RATIO * reference:
            back = k
        trace.append(
            {
                "chunk": k,
                "step": line["step"],
                "steps": line["steps"],
                "samples_per_s": own,
                "wall_samples_per_s": wall,
                "x_ref": own / reference if own else None,
                "world": line["world"],
                "compute_ms": [round(1e3 * c, 1) for c in _per_step_compute(line)],
                "after_restart": line["time"] > record["time"],
                # what else ran meanwhile: other jobs (cores) and Ray's processes but the ranks (CPU s)
                "other_cores": load.other(start, line["time"] + 0.25),
                "spare_cpu_s": load.spare_cpu(start, line["time"] + 0.25),
            }
        )
    first_after = next((t for t in trace if t["after_restart"]), None)
    wall_back = next(
        (
            t["chunk"]
            for t in trace
            if t["chunk"] > 0 and t["wall_samples_per_s"] and t["wall_samples_per_s"] >= TARGET_RATIO * reference
        ),
        None,
    )
    t0 = lines[detected]["time"]
    t1 = lines[detected + back]["time"] if back is not None else t0 + 5.0
    return {
        "evicted": True,
        "detected_step": lines[detected]["step"],
        "restart_step": record["step"],
        "steps_lost": record["steps_lost"],
        "spare": record.get("spare"),
        "path": record.get("path"),
        "recovery_s": record.get("recovery_s"),
        "chunks_to_0.9": back,
        "wall_chunks_to_0.9": wall_back,
        "first_chunk_after_restart": first_after["chunk"] if first_after else None,
        "back_s": t1 - t0 if back is not None else None,
        # from the detection to the chunk back at the target (or 5 s): other jobs' load, and the CPU of Ray's
        # processes but the ranks (the new hot spare starting in the freed bundle: on this same machine)
        "window_other_cores": load.other(t0, t1),
        "window_spare_cpu_s": load.spare_cpu(t0, t1),
        "replayed_streak": streaks[-1] if streaks else 0,
        # the driver's straggler warnings in the new group ("... going on" where no spare was ready)
        "flagged_after": [text for t, text in run["log"] if t > record["time"] and "slower than the median" in text],
        "trace": trace,
        "cause": record["cause"],
    }


# ---------------------------------------------------------------- torchrun + DDP


def ddp_rank(spec: dict[str, Any]) -> None:
    """A torchrun rank: the same model, data, global batch and SGD as raympi's, over gloo; every rank writes its pid,
    rank 0 a file once it passed ``spec["slow_from"]`` and, at the end, its wall time after each step."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    with torchrun_gloo() as (rank, world, barrier):
        Path(spec["dir"], f"pid-{rank}").write_text(str(os.getpid()))
        model = ddp(make_model())
        x, y = make_data(N)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        per_epoch, order, times = N // BATCH, None, []
        barrier()
        for step in range(spec["steps"]):
            epoch, i = divmod(step, per_epoch)
            if i == 0:
                order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED + epoch))
            idx = order[i * BATCH : (i + 1) * BATCH][rank::world]
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            times.append(time.time())
            if rank == 0 and step + 1 == spec["slow_from"]:
                Path(spec["dir"], "warm").touch()
        barrier()
    if rank == 0:
        Path(spec["result"]).write_text(json.dumps({"times": times, "first_step_wall": times[0]}))


def ddp_run(name: str, steps: int, slow_from: int) -> dict[str, Any]:
    """torchrun + DDP, rank 1 slowed from ``slow_from`` (rank 0's count) unless ``name`` is the reference."""
    folder = Path(tempfile.mkdtemp(prefix="ddp-stragglers-"))
    warm, pid = folder / "warm", folder / "pid-1"
    slowdown = Slowdown(warm.exists, lambda: int(pid.read_text())) if name == DDP_SLOW else None
    try:
        spec = write_spec(folder, "ddp", steps=steps, slow_from=slow_from)
        res = run_torchrun(__file__, spec, WORKERS)
        if slowdown is not None:
            slowdown.stop()
            if slowdown.started is None:
                raise RuntimeError(slowdown.error)
        times = res["times"]
        s0 = steps - steps // TAIL_SHARE
        half = slow_from // 2
        return {
            "samples_per_s": BATCH * (steps - s0) / (times[steps - 1] - times[s0 - 1]),
            "before": BATCH * (slow_from - half) / (times[slow_from - 1] - times[half - 1]),
            "slowed_from_step": slow_from if slowdown is not None else None,
            "restarts": [],
            "compute_ratio": None,
        }
    finally:
        if slowdown is not None:
            slowdown.stop()
        shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------- the table


def _med(values: list[Optional[float]]) -> Optional[float]:
    values = [v for v in values if v is not None and v == v]
    return statistics.median(values) if values else None


def _range(values: list[Optional[float]], f: str) -> str:
    values = [v for v in values if v is not None and v == v]
    if not values:
        return "-"
    text = format(statistics.median(values), f)
    return text if len(values) == 1 else f"{text} ({format(min(values), f)}-{format(max(values), f)})"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="runs of each contender (median, min-max)")
    parser.add_argument("--steps", type=int, default=300, help="steps a run")
    parser.add_argument("--slow-from", type=int, default=80, help="the slowdown starts after this step")
    parser.add_argument("--factor", type=float, default=2.0, help="straggler_factor of the eviction run")
    parser.add_argument("--chunks", type=int, default=2, help="straggler_chunks of every raympi run")
    parser.add_argument(
        "--only",
        default="",
        help="only the contenders whose name contains this text (or one of several, comma-separated)",
    )
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help=f"add '{NO_REFILL}': raympi starts no new hot spare after the eviction (patched in the driver)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: few steps, figures that mean nothing")
    parser.add_argument("--duty", type=int, help=argparse.SUPPRESS)
    add_child_options(parser)
    args = parser.parse_args(argv)
    if args.duty is not None:
        duty_cycle(args.duty)
        return 0
    if args.child == "ddp":
        ddp_rank(read_spec(args.spec))
        return 0
    steps, slow_from = (120, 30) if args.quick else (args.steps, args.slow_from)
    if steps - steps // TAIL_SHARE <= slow_from + 20:
        parser.error(f"--steps {steps} leaves no steady tail after --slow-from {slow_from}: raise --steps")
    names = [n for n in (*RAYMPI, *DDPS) if n != NO_REFILL or args.diagnose]
    if args.only:
        wanted = [text.strip() for text in args.only.split(",")]
        names = [n for n in names if any(text in n for text in wanted)]
        if not names:
            parser.error(f"no contender name contains {args.only!r}")

    import ray
    import torch

    print(
        f"stragglers: ray {ray.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs; MLP 784-{HIDDEN}-"
        f"{HIDDEN}-10, {WORKERS} ranks, global batch {BATCH}, {steps} steps, one rank slowed after step {slow_from} "
        f"(SIGSTOP {STOP_S * 1e3:.0f} ms / SIGCONT {RUN_S * 1e3:.0f} ms); eviction straggler_factor={args.factor:g}, "
        f"straggler_chunks={args.chunks}; tail: the last {steps // TAIL_SHARE} steps",
        flush=True,
    )
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    evictions: list[dict[str, Any]] = []
    failed = 0
    for run in range(max(1, args.runs)):
        groups = [[n for n in RAYMPI if n in names], [n for n in DDPS if n in names]]
        for group in groups:
            if not group:
                continue
            ctx = cluster_of(WORKERS + 1) if group[0] in RAYMPI else contextlib.nullcontext()
            with ctx as cluster:
                for name in rotated(group, run):
                    raylets = raylet_pids(list(cluster.worker_nodes)) if cluster is not None else None
                    started, load = time.monotonic(), Load(raylets)
                    try:
                        if name in RAYMPI:
                            out = raympi_run(cluster, name, steps, slow_from, args.factor, args.chunks)
                        else:
                            out = ddp_run(name, steps, slow_from)
                    except Exception as exc:
                        failed += 1
                        print(f"  run {run + 1} {name}: FAILED {type(exc).__name__}: {exc}", flush=True)
                        continue
                    finally:
                        other = load.stop()
                    out.update(name=name, run=run + 1, other_cores=other, load=load)
                    runs[name].append(out)
                    print(
                        f"  run {run + 1} {name}: {out['samples_per_s']:.0f} samples/s over the tail"
                        + (f", restarts {out['restarts']}" if out["restarts"] else "")
                        + f" ({time.monotonic() - started:.0f} s; other jobs {fmt(other, '.2f')} cores)",
                        flush=True,
                    )
            # The eviction against the un-slowed raympi of the same run (else its own run's pace before the slowdown).
            for out in [o for name in EVICTING for o in runs.get(name, [])]:
                if out["run"] != run + 1 or "eviction" in out:
                    continue
                refs = [r["samples_per_s"] for r in runs.get(REF, []) if r["run"] == run + 1]
                reference = refs[0] if refs else out["before"]
                out["eviction"] = eviction(out, reference, args.factor, args.chunks)
                out["reference"] = reference
                evictions.append({"contender": out["name"], "run": run + 1, **out["eviction"]})

    return _report(names, runs, evictions, args, steps) or (1 if failed else 0)


def _report(
    names: list[str], runs: dict[str, list[dict[str, Any]]], evictions: list[dict[str, Any]], args: Any, steps: int
) -> int:
    refs = {REF: REF, EVICT: REF, KEEP: REF, NO_REFILL: REF, DDP_REF: DDP_REF, DDP_SLOW: DDP_REF}
    header = (
        f"{'contender':<40} | {'samples/s, tail':>22} | {'x un-slowed':>17} | {'x own pace before':>17} | "
        f"{'compute x peer':>14} | {'restarts':>11} | {'other jobs, cores':>17}"
    )
    lines = [header, "-" * len(header)]
    rows = []
    for name in names:
        got = runs[name]
        if not got:
            lines.append(f"{name:<40} | {'failed':>22} |")
            continue
        sps = [r["samples_per_s"] for r in got]
        ref = [r["samples_per_s"] for r in runs.get(refs[name], [])]
        # Ratios within a run, then their median: only the same run's figures compare.
        by_run = {r["run"]: r["samples_per_s"] for r in runs.get(refs[name], [])}
        ratios = [r["samples_per_s"] / by_run[r["run"]] for r in got if r["run"] in by_run]
        kinds = sorted({k for r in got for k in r["restarts"]})
        restarts = ", ".join(f"{k} {sum(r['restarts'].count(k) for r in got)}" for k in kinds) or "none"
        own = [r["samples_per_s"] / r["before"] if r.get("before") else None for r in got]
        lines.append(
            f"{name:<40} | {_range(sps, '.0f'):>22} | {_range(ratios, '.2f') if ref else '-':>17} | "
            f"{_range(own, '.2f'):>17} | {_range([r['compute_ratio'] for r in got], '.2f'):>14} | {restarts:>11} | "
            f"{_range([r['other_cores'] for r in got], '.2f'):>17}"
        )
        for r in got:
            rows.append(
                {
                    "contender": name,
                    "run": r["run"],
                    "samples_per_s": r["samples_per_s"],
                    "x_unslowed": r["samples_per_s"] / by_run[r["run"]] if r["run"] in by_run else None,
                    "before_samples_per_s": r.get("before"),
                    "x_own_before": r["samples_per_s"] / r["before"] if r.get("before") else None,
                    "compute_x_peer": r["compute_ratio"],
                    "other_cores": r["other_cores"],
                    "slowed_from_step": r["slowed_from_step"],
                    "restarts": " ".join(r["restarts"]),
                    **{
                        k: v
                        for k, v in r.get("eviction", {}).items()
                        if k not in ("trace", "evicted") and not isinstance(v, list)
                    },
                }
            )
    for out in [o for name in EVICTING for o in runs.get(name, [])]:
        ev = out.get("eviction")
        if not ev:
            continue
        lines.append("")
        if not ev["evicted"]:
            lines.append(f"{out['name']}, run {out['run']}: {ev['note']}")
            continue
        after = out["samples_per_s"] / out["reference"]
        own = f", {out['samples_per_s'] / out['before']:.2f}x its own pace before the slowdown" if out["before"] else ""
        back = ev["chunks_to_0.9"]
        met = back is not None and back <= TARGET_CHUNKS
        lines.append(
            f"{out['name']}, run {out['run']}: detected at step {ev['detected_step']} (slowed from step "
            f"{out['slowed_from_step']}), re-formed at step {ev['restart_step']} (path {ev['path']}, spare "
            f"{ev['spare']}, {ev['steps_lost']} step(s) lost, {fmt(ev['recovery_s'], '.2f')} s to the first step); "
            f"tail after it {after:.2f}x the un-slowed raympi{own}; back at >= {TARGET_RATIO} of it "
            f"{back if back is not None else 'never'} chunk(s) after the detection (by the wall clock between chunk "
            f"ends, restart included: {ev['wall_chunks_to_0.9'] if ev['wall_chunks_to_0.9'] is not None else 'never'}"
            f"); target <= {TARGET_CHUNKS}: {'met' if met else 'NOT met'}"
        )
        lines.append(
            f"from the detection to back at {TARGET_RATIO} ({fmt(ev['back_s'], '.2f')} s; else the 5 s after it): "
            f"other jobs {fmt(ev['window_other_cores'], '.2f')} cores; Ray's processes but the ranks (the new hot "
            f"spare starting) {ev['window_spare_cpu_s']:.2f} CPU s"
        )
        for text in ev["flagged_after"]:
            lines.append(f"after the eviction, the driver logged: {text}")
        if ev["replayed_streak"] < args.chunks:
            lines.append(f"(the rule replayed on ranks.jsonl gives a streak of {ev['replayed_streak']} there)")
        lines.append(
            f"{'chunk':>5} {'step':>5} {'steps':>5} {'samples/s':>9} {'wall':>7} {'x ref':>6} {'other':>5} "
            f"{'spare':>5}  compute ms a step per rank"
        )
        for t in ev["trace"]:
            if -3 <= t["chunk"] <= 10:
                lines.append(
                    f"{t['chunk']:>5} {t['step']:>5} {t['steps']:>5} {fmt(t['samples_per_s'], '9.0f')} "
                    f"{fmt(t['wall_samples_per_s'], '7.0f')} {fmt(t['x_ref'], '6.2f')} {fmt(t['other_cores'], '5.2f')} "
                    f"{fmt(t['spare_cpu_s'], '5.2f')}  {t['compute_ms']}"
                    + ("  (new group)" if t["after_restart"] and t["chunk"] > 0 else "")
                )
        spare_lines = [f"{t - out['slow_at']:+.2f} s {text}" for t, text in out["log"] if out["slow_at"]]
        if spare_lines:
            lines.append("driver log (time from the slowdown's start): " + "; ".join(spare_lines[-6:]))
    table = "\n".join(lines)
    stem = "stragglers_quick" if args.quick else ("stragglers_only" if args.only else "stragglers")
    if rows:
        fields = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
        write_csv(OUT / f"{stem}.csv", rows, fields)
    if evictions:
        trace_rows = [
            {"contender": e["contender"], "run": e["run"], **t} for e in evictions for t in e.get("trace", [])
        ]
        if trace_rows:
            write_csv(OUT / f"{stem}_chunks.csv", trace_rows)
    (OUT / f"{stem}.txt").parent.mkdir(parents=True, exist_ok=True)
    (OUT / f"{stem}.txt").write_text(table + "\n")
    print("\n" + table)
    print(f"\nwrote {OUT / (stem + '.csv')}, {OUT / (stem + '.txt')}")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
