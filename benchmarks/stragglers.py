"""Throughput with one of 2 ranks slowed 3x: raympi evicting the straggler for a hot spare, raympi keeping it,
and torchrun + DDP, each against its own un-slowed run, side by side.

Once a run is warm (past step 80 of 300, raympi's with its hot spare in), a process of its own stops one rank's
process for 100 ms and lets it run for 50 ms, over and over (its compute 3x as long, as on a throttled node):

    raympi                        un-slowed: the reference of the raympi rows
    raympi slowed, eviction on    straggler_factor=--factor, straggler_chunks=--chunks: the hot spare takes its place
    raympi slowed, eviction off   straggler_factor=None: the slowed rank stays
    raympi slowed, no new spare   (--diagnose) the eviction with no hot spare started after it (patched in the driver)
    torchrun + DDP                un-slowed, gloo: the reference of the DDP rows; "slowed": rank 1 slowed

raympi runs on a ray.cluster_utils.Cluster of a 0-CPU head and three 1-CPU nodes (a straggler is evicted only for a
spare on another node).  All train the MLP 784-1024-1024-10 with SGD, global batch 512, 1 torch thread a process.
Measured: samples/s over the last third of the steps, against the same framework's un-slowed run of the round; the
slowest rank's compute per step against its peer's (over raympi's chunks run slowed); other jobs' load on the
machine.  For an eviction: the chunk whose completion found the straggler (the driver's rule, replayed), and the
chunks after it until one runs at >= 0.9 of the un-slowed raympi (the target: within 2), with their seconds.  Each
run's figures go to benchmarks/out/stragglers.csv, the table to stragglers.txt (stragglers_quick.* with --quick).

    python benchmarks/stragglers.py --runs 3 --diagnose  # medians of 3 rounds (min-max), ~2.5 minutes a round
    python benchmarks/stragglers.py --quick              # a smoke run: raympi, its eviction, DDP slowed
"""

from __future__ import annotations

import argparse
import contextlib
import json
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

from _common import (  # noqa: E402  (benchmarks/_common.py: what the benchmarks share)
    SEED,
    add_child_options,
    attempt,
    ddp,
    fmt,
    median_range,
    one_cpu_nodes,
    raylet_pids,
    read_spec,
    rotated,
    run_torchrun,
    save_results,
    spare_joins,
    steady_samples_per_s,
    synthetic_mnist,
    torchrun_gloo,
    training_workers,
    write_spec,
)

WORKERS, BATCH, N, LR = 2, 512, 16384, 0.01  # 256 samples per rank and step, 32 steps an epoch
STOP_S, RUN_S = 0.1, 0.05  # the duty cycle: stopped 2/3 of the time, compute 3x as long
TARGET_RATIO, TARGET_CHUNKS = 0.9, 2  # back at >= 0.9 of the un-slowed samples/s within 2 chunks of the detection
REF, EVICT, KEEP = "raympi", "raympi slowed, eviction on", "raympi slowed, eviction off"
NO_SPARE, DDP_REF, DDP_SLOW = "raympi slowed, no new spare", "torchrun + DDP", "torchrun + DDP slowed"
FIT = dict(workers=WORKERS, batch_size=BATCH, seed=SEED, torch_threads=1, checkpoint_every=0, keep_workers=False)
COLUMNS = (("samples_per_s", ".0f"), ("x_unslowed", ".2f"), ("compute_x_peer", ".2f"), ("other_cores", ".2f"))


def make_model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(SEED)
    layers = [nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)]
    return nn.Sequential(nn.Flatten(), *layers)


# ---------------------------------------------------------------- the slowdown and the machine's load


def duty_cycle(pid: int) -> None:
    """Stop ``pid`` for STOP_S, let it run for RUN_S, over and over until it is gone or SIGTERM; left running."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(STOP_S)
            os.kill(pid, signal.SIGCONT)
            time.sleep(RUN_S)
    except ProcessLookupError:  # gone: evicted, or the run ended
        pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def slow(pid: int) -> subprocess.Popen:
    """:func:`duty_cycle` on ``pid`` in a process of its own (this script with ``--duty``: no thread delays it)."""
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--duty", str(pid)])


class Load(threading.Thread):
    """Other jobs' load on the shared machine, in cores, every 0.5 s: its busy CPU less this process tree's (this
    process, its Ray cluster, torchrun, the ranks), process by process (one that ends takes its CPU with it)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples, self.done = [], threading.Event()  # samples: (wall time, other jobs' cores since the last)
        self.start()

    def run(self) -> None:
        import psutil

        def now(me: Any = psutil.Process()) -> tuple[float, float, dict[int, float]]:
            tree = {}
            for proc in [me, *me.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    tree[proc.pid] = sum(proc.cpu_times()[:2])
            m = psutil.cpu_times()
            return time.monotonic(), m.user + m.nice + m.system + m.irq + m.softirq + m.steal, tree

        last = now()
        while not self.done.wait(0.5):
            new = now()
            ours = sum(max(0.0, cpu - last[2].get(pid, 0.0)) for pid, cpu in new[2].items())
            self.samples.append((time.time(), max(0.0, new[1] - last[1] - ours) / (new[0] - last[0])))
            last = new

    def mean(self, start: float = 0.0, end: float = float("inf")) -> Optional[float]:
        inside = [cores for t, cores in self.samples if start < t <= end]
        return statistics.mean(inside) if inside else None


# ---------------------------------------------------------------- raympi


class Slowdown:
    """A fit callback: once past ``slow_from`` with its hot spare joined, a training rank of ``raylets`` slowed (from
    a thread: finding it takes 0.3 s); the ranks.jsonl lines (each chunk's seconds per rank) as they come."""

    def __init__(self, raylets: Optional[set[int]], slow_from: int) -> None:
        self.raylets, self.slow_from, self.joined, self.lines = raylets, slow_from, spare_joins(), []
        self.thread = self.proc = self.at = None  # at: the wall time the slowdown started

    def on_step(self, record: dict[str, Any]) -> None:
        if self.raylets and not self.thread and record["step"] >= self.slow_from and self.joined.is_set():
            self.thread = threading.Thread(target=self._start, daemon=True)
            self.thread.start()

    def _start(self) -> None:
        self.proc, self.at = slow(training_workers(self.raylets)[-1].pid), time.time()

    def on_ranks(self, line: dict[str, Any]) -> None:
        self.lines.append(line)


def raympi_run(name: str, raylets: set[int], steps: int, slow_from: int, factor: float, chunks: int) -> dict:
    """One ``raympi.fit`` on the cluster; slowed (unless ``name`` is REF) once past ``slow_from`` with its spare in."""
    import raympi
    from raympi.driver import group

    watch, folder = Slowdown(raylets if name != REF else None, slow_from), tempfile.mkdtemp(prefix="raympi-")
    start_spare = group.WorkerGroup._start_spare
    if name == NO_SPARE:  # its spare joined before the slowdown: none is started after it, after the eviction
        group.WorkerGroup._start_spare = lambda self, i: None if watch.at else start_spare(self, i)
    run = dict(max_steps=steps, epochs=-(-steps * BATCH // N), checkpoint_dir=folder, optimizer=raympi.optim.sgd(LR))
    rule = dict(straggler_factor=None if name == KEEP else factor, straggler_chunks=chunks, callbacks=[watch])
    try:
        result = raympi.fit(make_model(), synthetic_mnist(N), progress=False, **run, **rule, **FIT)
    finally:
        group.WorkerGroup._start_spare = start_spare
        shutil.rmtree(folder, ignore_errors=True)
        if watch.thread is not None:
            watch.thread.join(30)
        if watch.proc is not None:
            watch.proc.terminate()  # our child: it lets the victim run on its way out
            watch.proc.wait(10)
    if name != REF and watch.at is None:
        raise RuntimeError("the slowdown never started (the run ended before it was warm)")
    evicted = [r for r in result.restarts if r["kind"] == "straggler"]
    return {
        "samples_per_s": steady_samples_per_s(result.metrics, steps, steps - steps // 3, BATCH),
        "restarts": " ".join(r["kind"] for r in result.restarts),
        "compute_x_peer": compute_ratio(watch.lines, watch.at, result.restarts) if watch.at else None,
        "_lines": watch.lines,
        "_pace": {m["step"]: m.get("samples_per_s") for m in result.metrics},  # none where reconstructed
        "_evicted": evicted[0] if evicted else None,
        "_slowed_at": watch.at,
    }


def compute_ratio(lines: list[dict], slowed_at: float, restarts: list[dict]) -> Optional[float]:
    """The slowest rank's compute per step against its peer's: the median over the chunks run slowed, no restart."""
    from raympi.driver.report import ms_per_step

    end = min((r["time"] for r in restarts), default=float("inf"))
    ms = [ms_per_step(b, "compute_s") for a, b in zip(lines, lines[1:]) if a["time"] >= slowed_at and b["time"] < end]
    return statistics.median(max(m) / max(min(m), 1e-9) for m in ms) if ms else None


def eviction(row: dict[str, Any], reference: float, factor: float, chunks: int) -> None:
    """The eviction of ``row``'s run against the un-slowed raympi's samples/s ``reference``, into ``row``.  The
    detection: the first chunk ended slowed where the driver's own rule, replayed, finds the straggler."""
    from raympi.driver.stragglers import StragglerRule, StragglerWatch
    from raympi.worker.results import StepTimes

    lines, record, pace, rule = row["_lines"], row["_evicted"], row["_pace"], StragglerRule(factor, chunks)
    judge = StragglerWatch(rule).observe
    slowed = [i for i, line in enumerate(lines) if row["_slowed_at"] <= line["time"] < record["time"]]
    found = (i for i in slowed if judge([StepTimes(compute_s=c) for c in lines[i]["compute_s"]], lines[i]["steps"])[0])
    detected = next(found, slowed[-1])
    t0, after = lines[detected]["time"], lines[detected + 1 :]
    x = [(pace.get(line["step"]) or 0.0) / reference for line in after]
    back = next((k for k, ratio in enumerate(x, 1) if ratio >= TARGET_RATIO), None)
    t1 = after[back - 1]["time"] if back else t0 + 5.0
    old = sum(line["time"] < record["time"] for line in after)  # the chunks the old group still ran
    trace = [f"{r:.2f} ({line['steps']})" for r, line in zip(x[:10], after)]
    row.update(detected_step=lines[detected]["step"], detected_after_s=t0 - row["_slowed_at"], chunks_back=back)
    row.update(steps_lost=record["steps_lost"], recovery_s=record.get("recovery_s"), seconds_back=back and t1 - t0)
    row.update(window_other_cores=row["_load"].mean(t0, t1), trace=" ".join(trace[:old] + ["|"] + trace[old:]))


# ---------------------------------------------------------------- torchrun + DDP


def ddp_rank(spec: dict[str, Any]) -> None:
    """A torchrun rank: raympi's model, data, batch and SGD over gloo; rank 0 writes its wall time after each step."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    with torchrun_gloo() as (rank, world, barrier):
        model, (x, y) = ddp(make_model()), synthetic_mnist(N)
        opt, order, times = torch.optim.SGD(model.parameters(), lr=LR), torch.randperm(N), []
        barrier()
        for step in range(spec["steps"]):
            i = step % (N // BATCH) * BATCH
            idx = order[i : i + BATCH][rank::world]
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            times.append(time.time())
            if rank == 1 and spec["slowed"] and step + 1 == spec["slow_from"]:
                slow(os.getpid())  # it ends when this process is gone
        barrier()
    if rank == 0:
        Path(spec["result"]).write_text(json.dumps({"times": times, "first_step_wall": times[0]}))


def ddp_run(name: str, steps: int, slow_from: int) -> dict[str, Any]:
    """torchrun + DDP over 2 processes, rank 1 slowed past ``slow_from`` unless ``name`` is DDP_REF."""
    with tempfile.TemporaryDirectory(prefix="ddp-stragglers-") as folder:
        spec = write_spec(Path(folder), "ddp", steps=steps, slow_from=slow_from, slowed=name == DDP_SLOW)
        times = run_torchrun(__file__, spec, WORKERS)["times"]
    return {"samples_per_s": BATCH * (steps // 3) / (times[-1] - times[-1 - steps // 3]), "restarts": ""}


# ---------------------------------------------------------------- rounds and the table


def measure(name: str, run: int, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One contender's run as a row: ``fn()``'s figures (or its error), other jobs' load meanwhile."""
    row: dict[str, Any] = {"contender": name, "run": run + 1, "samples_per_s": None, "x_unslowed": None}
    row.update(compute_x_peer=None, restarts="", other_cores=None, error="", _load=Load())
    started = time.monotonic()
    attempt(row, fn)
    row["_load"].done.set()
    row["other_cores"] = row["_load"].mean()
    got = f"{row['samples_per_s']:.0f} samples/s over the tail" if row["samples_per_s"] else row["error"]
    got += f", restarts: {row['restarts']}" if row["restarts"] else ""
    print(f"  run {run + 1} {name}: {got} ({time.monotonic() - started:.0f} s)", flush=True)
    return row


def table(rows: list[dict[str, Any]], names: list[str]) -> str:
    header = f"{'contender':<28} | {'samples/s, tail':>21} | {'x un-slowed':>18} | {'compute x peer':>18} | "
    header += f"{'other jobs, cores':>18} | restarts"
    lines = [header, "-" * len(header)]
    for name in names:
        got = [r for r in rows if r["contender"] == name and r["samples_per_s"]]
        cols = [median_range([r[k] for r in got if r[k] is not None], f) for k, f in COLUMNS]
        kinds = sorted({k for r in got for k in r["restarts"].split()})
        restarts = ", ".join(f"{k} {sum(r['restarts'].split().count(k) for r in got)}" for k in kinds) or "none"
        lines.append(f"{name:<28} | {cols[0]:>21} | {cols[1]:>18} | {cols[2]:>18} | {cols[3]:>18} | {restarts}")
    for r in rows:
        if "chunks_back" in r:
            met = "met" if r["chunks_back"] and r["chunks_back"] <= TARGET_CHUNKS else "NOT met"
            back = f"{r['chunks_back']} chunk(s) ({r['seconds_back']:.2f} s)" if r["chunks_back"] else "in no chunk"
            lines.append(
                f"\n{r['contender']}, run {r['run']}: the straggler found at step {r['detected_step']}, "
                f"{r['detected_after_s']:.1f} s into the slowdown; {r['steps_lost']} step(s) lost, "
                f"{fmt(r['recovery_s'], '.2f')} s to the first step after; back at >= {TARGET_RATIO} of the un-slowed "
                f"raympi {back} after the detection "
                f"(target <= {TARGET_CHUNKS}: {met}); other jobs {fmt(r['window_other_cores'], '.2f')} cores meanwhile"
            )
            lines.append(f"  x un-slowed (steps) of the chunks after it, | where the new group starts: {r['trace']}")
        elif r["contender"] in (EVICT, NO_SPARE) and r["samples_per_s"]:
            why = "no eviction" if r["_evicted"] is None else "evicted; the un-slowed raympi of its round failed"
            lines.append(f"\n{r['contender']}, run {r['run']}: {why}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=1, help="rounds of every contender (medians, min-max)")
    p.add_argument("--factor", type=float, default=2.0, help="straggler_factor of the eviction")
    p.add_argument("--chunks", type=int, default=2, help="straggler_chunks of every raympi run")
    p.add_argument("--diagnose", action="store_true", help=f"add '{NO_SPARE}'")
    p.add_argument("--quick", action="store_true", help="a smoke run: raympi, its eviction and DDP slowed, 100 steps")
    p.add_argument("--duty", type=int, help=argparse.SUPPRESS)
    add_child_options(p)
    args = p.parse_args(argv)
    if args.duty or args.child:  # one of this script's own processes: the duty cycle, or a torchrun rank
        duty_cycle(args.duty) if args.duty else ddp_rank(read_spec(args.spec))
        return 0
    steps, slow_from = (100, 20) if args.quick else (300, 80)
    raympis = [REF, EVICT] + ([] if args.quick else [KEEP]) + ([NO_SPARE] if args.diagnose else [])
    ddps = [DDP_SLOW] if args.quick else [DDP_REF, DDP_SLOW]
    rule = f"straggler_factor={args.factor:g}, straggler_chunks={args.chunks}"
    print(f"stragglers: {steps} steps, one of {WORKERS} ranks slowed 3x after step {slow_from}; {rule}", flush=True)
    rows = []
    for run in range(args.runs):
        with one_cpu_nodes(WORKERS + 1) as nodes:
            raylets = raylet_pids(list(nodes.worker_nodes))
            for name in rotated(raympis, run):
                fn = lambda name=name: raympi_run(name, raylets, steps, slow_from, args.factor, args.chunks)  # noqa: E731
                rows.append(measure(name, run, fn))
        rows += [measure(name, run, lambda name=name: ddp_run(name, steps, slow_from)) for name in rotated(ddps, run)]
    for row in rows:  # against the un-slowed run of the same framework and round
        ref_name = REF if row["contender"] in raympis else DDP_REF
        ref = [r["samples_per_s"] for r in rows if r["contender"] == ref_name and r["run"] == row["run"]]
        if ref and ref[0] and row["samples_per_s"]:
            row["x_unslowed"] = row["samples_per_s"] / ref[0]
            if row.get("_evicted"):
                eviction(row, ref[0], args.factor, args.chunks)
    fields = list(dict.fromkeys(k for r in rows for k in r if not k.startswith("_")))  # the evictions' last
    csv_rows = [{k: r.get(k) for k in fields} for r in rows]
    save_results("stragglers_quick" if args.quick else "stragglers", csv_rows, table(rows, raympis + ddps))
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
