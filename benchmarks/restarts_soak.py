"""Warm restarts in a row, and no false alarms under load (issue 22, items 3 and 6).

Part "kills" (``--kills N``): one ``fit`` run, 2 workers and a hot spare on a local Ray of 3 CPUs.
Each time a hot spare has joined the standby communicator, one training worker is SIGKILLed: N warm
restarts in a row.  The table counts how each one was carried out (derived from the standby
communicator, connected anew, or cold) and gives ``recovery_s`` (failure noticed -> first step).

Part "load" (``--load X --minutes M``): X busy-loop processes per core load the machine (2 workers
on 2 cores then share them with 2X other processes); ``fit`` trains for M minutes and every restart is
a false alarm (there is no failure).  Then, in the same conditions, one worker is SIGSTOPped: the
time until the driver found it (the restart record's ``detect_s`` plus what preceded the notice).

Run:
    python benchmarks/restarts_soak.py --kills 100                 # about 8 minutes on 2 cores
    python benchmarks/restarts_soak.py --load 1.5 --minutes 10     # 3 busy loops on 2 cores (nice 0: --nice)
    python benchmarks/restarts_soak.py --quick                     # 2 kills (tests)
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import raympi  # noqa: E402
from _common import OMP1, own_raylets, save_results, spare_joins, start_local_ray, training_workers  # noqa: E402

if __name__ != "__main__":  # imported (by a test, say): Ray's workers cannot import this module
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

PACE_S = 0.005
FIELDS = ["part", "step", "kind", "path", "reformed", "recovery_s", "steps_lost", "warm_skipped", "cause", "found_s"]


class Paced(nn.Sequential):
    """A 784-256-10 MLP that sleeps PACE_S per forward (pickled by value: workers cannot import benchmarks/)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(PACE_S)
        return super().forward(x)


class StopAfter(raympi.callbacks.Callback):
    """Stops the run ``seconds`` after its first step."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.started = seconds, None

    def on_step(self, record: dict[str, Any]) -> bool:
        self.started = self.started or time.monotonic()
        return time.monotonic() - self.started > self.seconds


def _fit(steps: int, folder: str, **options: Any) -> raympi.Result:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4096, 784, generator=g), torch.randint(0, 10, (4096,), generator=g)
    return raympi.fit(
        Paced(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10)),
        (x, y),
        workers=2,
        batch_size=64,
        epochs=10**6,
        max_steps=steps,
        checkpoint_every=100,
        checkpoint_dir=folder,
        progress=False,
        torch_threads=1,
        max_restarts=10**6,
        optimizer=raympi.optim.adam(1e-3),
        **options,
    )


def _kill_each_time_a_spare_joins(
    kills: int,
    raylets: set[int],
    sig: int,
    fired: list[float],
    anyway_s: float | None = None,
    steady: threading.Event | None = None,
) -> threading.Event:
    """A thread that signals one training worker each time a spare joined, ``kills`` times (``anyway_s``:
    after that long without a spare, signal one all the same; ``steady``: not before this event is set,
    the run past its start); the returned event is set when done."""
    joins, done = spare_joins(), threading.Event()

    def run() -> None:
        try:
            if steady is not None:
                steady.wait(timeout=1800)
            while len(fired) < kills:
                if not joins.event.wait(timeout=anyway_s or 120) and anyway_s is None:
                    break
                joins.clear()
                time.sleep(0.3)  # a few steps on the full group first
                victim = training_workers(raylets, patience_s=600.0 if anyway_s else 10.0)[-1]
                fired.append(time.time())
                os.kill(victim.pid, sig)
        finally:
            done.set()  # the run stops, whatever became of the kills

    threading.Thread(target=run, daemon=True).start()
    return done


def part_kills(kills: int) -> tuple[list[dict[str, Any]], str]:
    start_local_ray(3, env=OMP1, log_to_driver=False)
    fired: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        done = _kill_each_time_a_spare_joins(kills, own_raylets(), signal.SIGKILL, fired)

        class StopWhenDone(raympi.callbacks.Callback):
            def on_step(self, record: dict[str, Any]) -> bool:
                return done.is_set()

        started = time.monotonic()
        result = _fit(10**7, folder, callbacks=[StopWhenDone()])
        seconds = time.monotonic() - started
    import ray

    ray.shutdown()
    restarts = [r for r in result.restarts if r["kind"] == "worker_lost"]
    how = [r.get("reformed") or r["path"] for r in restarts]
    recovery = [r["recovery_s"] for r in restarts if r.get("recovery_s") is not None]
    rows = [{"part": "kills", **{k: r.get(k) for k in FIELDS[1:] if k in r}} for r in restarts]
    table = (
        f"{len(fired)} workers killed, {len(restarts)} warm/cold restarts in {seconds:.0f} s: "
        f"derived {how.count('derived')}, connected {how.count('connected')}, cold {how.count('cold')}; "
        f"steps lost {sum(r.get('steps_lost') or 0 for r in restarts)}; recovery_s median "
        f"{statistics.median(recovery):.3f} s, max {max(recovery):.3f} s"
        if recovery
        else f"{len(fired)} workers killed, no restart recorded"
    )
    return rows, table


def _busy(stop: Any, nice: int) -> None:
    os.nice(nice)
    while not stop.is_set():
        sum(range(10000))


def part_load(load: float, minutes: float, nice: int) -> tuple[list[dict[str, Any]], str]:
    cores = len(os.sched_getaffinity(0))
    stop = multiprocessing.Event()
    hogs = [multiprocessing.Process(target=_busy, args=(stop, nice), daemon=True) for _ in range(round(load * cores))]
    for h in hogs:
        h.start()
    try:
        start_local_ray(3, env=OMP1, log_to_driver=False)
        with tempfile.TemporaryDirectory() as folder:
            result = _fit(10**7, folder, callbacks=[StopAfter(minutes * 60)])
        alarms = [r for r in result.restarts if r["kind"] in ("hung", "worker_lost", "collective")]
        steps = result.metrics[-1]["step"]
        print(
            f"{len(hogs)} busy processes: {len(alarms)} false alarm(s) in {minutes:g} min ({steps} steps)", flush=True
        )
        fired: list[float] = []
        with tempfile.TemporaryDirectory() as folder:
            # A loaded machine may take minutes to start the workers and a spare: the stop comes once the run
            # is past its first 50 steps, and a spare has joined or 60 s went by.
            steady = threading.Event()
            done = _kill_each_time_a_spare_joins(1, own_raylets(), signal.SIGSTOP, fired, anyway_s=60, steady=steady)

            class StopSoonAfter(raympi.callbacks.Callback):
                def on_step(self, record: dict[str, Any]) -> bool:
                    if record["step"] >= 50:
                        steady.set()
                    return done.is_set() and (not fired or time.time() > fired[0] + 10)

            stopped = _fit(10**7, folder, callbacks=[StopSoonAfter()])
        hung = [r for r in stopped.restarts if r["kind"] == "hung"]
        found_s = (hung[0]["time"] - fired[0]) if hung and fired else None
    finally:
        stop.set()
        for h in hogs:
            h.join(5)
        import ray

        ray.shutdown()
    rows = [{"part": "load", "kind": r["kind"], "step": r["step"], "cause": r["cause"]} for r in alarms]
    rows.append({"part": "load", "kind": "sigstop", "found_s": found_s})
    table = (
        f"{len(hogs)} busy processes (nice {nice}) on {cores} cores, {minutes:g} min of training ({steps} steps): "
        f"{len(alarms)} restart(s) without a failure"
        + "".join(f"\n  false alarm at step {r['step']}: {r['cause']}" for r in alarms)
        + (
            f"\nSIGSTOP in the same conditions: found after {found_s:.2f} s"
            if found_s is not None
            else "\nSIGSTOP in the same conditions: NOT found as a hung rank"
        )
    )
    return rows, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=0, help="warm restarts in a row")
    parser.add_argument("--load", type=float, default=0.0, help="busy-loop processes per core")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="the busy loops' niceness: 0 (other jobs' default) starves Ray's workers, which run at nice 15; "
        "15 shares the cores evenly with them",
    )
    parser.add_argument("--quick", action="store_true", help="2 kills, no load part (tests)")
    args = parser.parse_args()
    if args.quick:
        args.kills, args.load = 2, 0.0
    if not (args.kills or args.load):
        parser.error("give --kills N and/or --load X")
    rows, tables = [], []
    if args.kills:
        part, table = part_kills(args.kills)
        rows += part
        tables.append(table)
    if args.load:
        part, table = part_load(args.load, args.minutes, args.nice)
        rows += part
        tables.append(table)
    rows = [{f: row.get(f) for f in FIELDS} for row in rows]
    save_results("restarts_soak_quick" if args.quick else "restarts_soak", rows, "\n".join(tables))


if __name__ == "__main__":
    main()
