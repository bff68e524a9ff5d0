"""Chaos soak: a seeded schedule of faults against one long ``raympi.fit``, on a multi-node cluster.

A ``ray.cluster_utils.Cluster`` of one-CPU nodes (the head holds none) runs ``workers`` ranks with
one node to spare.  Every ``--every`` seconds one fault from a fixed-seed schedule hits the run:
kill -9 of a worker, SIGSTOP of a worker (a hang), removing a node and adding one back, SIGTERM of
a worker (a preemption), and kill -9 of a worker while a checkpoint is being written.  The same
training runs once without faults first.  Printed: faults injected and recovered, steps lost,
throughput against the fault-free run, final parameters against it, and processes left over.

    python benchmarks/chaos.py                    # 5 minutes, a fault every ~15 s
    python benchmarks/chaos.py --quick            # about a minute, 4 faults
    python benchmarks/chaos.py --shard-optimizer  # the same with the optimizer state sharded over the ranks
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import psutil
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import raympi  # noqa: E402

FAULTS = ["kill", "stop", "node", "sigterm", "kill_in_checkpoint"]
N, DIM = 4096, 20


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, DIM, generator=g)
    return x, (x[:, 0] + x[:, 1] > 0).long()


class Slow(nn.Sequential):
    """An MLP taking at least 15 ms a step, so that faults land mid-step."""

    def forward(self, x):
        time.sleep(0.015)
        return super().forward(x)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return Slow(nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, 2))


# Every process of this run's cluster inherits this tag (its nodes start from this process, Ray's workers
# from their raylet): faults never hit, and counts never see, another Ray instance's workers on the machine.
RUN_TAG = "RAYMPI_CHAOS_RUN"
os.environ[RUN_TAG] = f"{os.getpid()}-{time.time_ns()}"


def _ours(p: psutil.Process) -> bool:
    try:
        return p.environ().get(RUN_TAG) == os.environ[RUN_TAG]
    except (psutil.Error, OSError):
        return False


def worker_processes() -> list[psutil.Process]:
    """This run's live raympi worker processes (Ray titles them 'ray::Worker...'), oldest first."""
    found = []
    for p in psutil.process_iter(["cmdline", "status", "create_time"]):
        cmd = p.info["cmdline"] or []
        if cmd and cmd[0].startswith("ray::Worker") and p.info["status"] != psutil.STATUS_ZOMBIE and _ours(p):
            found.append(p)
    return sorted(found, key=lambda p: p.info["create_time"])


def _victim(rng: random.Random) -> psutil.Process | None:
    """A worker that is training: Ray titles a rank running a chunk of steps ``ray::Worker.run`` (a hot spare waits
    untitled); watched for up to 1 s, since a rank waits between chunks.  Else one that used CPU in 0.2 s (on a
    loaded machine a spare still importing torch does too), else any."""
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        ranks = [p for p in worker_processes() if p.info["cmdline"][0].startswith("ray::Worker.run")]
        if ranks:
            return rng.choice(ranks)
        time.sleep(0.01)
    procs = worker_processes()
    before = {}
    for p in procs:
        try:
            before[p.pid] = sum(p.cpu_times()[:2])
        except psutil.Error:
            pass
    time.sleep(0.2)
    busy = []
    for p in procs:
        try:
            if p.pid in before and sum(p.cpu_times()[:2]) > before[p.pid] + 0.01:
                busy.append(p)
        except psutil.Error:
            pass
    return rng.choice(busy or procs) if procs else None


class Chaos:
    """Injects the schedule's faults into a running fit, from a background thread."""

    def __init__(self, cluster, folder: Path, faults: int, every_s: float, seed: int) -> None:
        self.cluster, self.folder, self.faults, self.every_s = cluster, folder, faults, every_s
        self.rng = random.Random(seed)
        self.schedule = [FAULTS[i % len(FAULTS)] for i in range(faults)]
        self.rng.shuffle(self.schedule)
        self.injected: list[tuple[float, str]] = []
        self.added: list = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        # Faults hit training: the schedule starts once the first checkpoint is written (a fault while
        # the workers start is a startup failure, another story), then half a period later.
        while not any(p.name.startswith("step-") for p in self.folder.iterdir()):
            if self.stop.wait(0.05):
                return
        if self.stop.wait(self.every_s / 2):
            return
        for fault in self.schedule:
            getattr(self, "_" + fault)()
            self.injected.append((time.time(), fault))
            if self.stop.wait(self.every_s * self.rng.uniform(0.8, 1.2)):
                return

    def _signal(self, sig: int) -> None:
        victim = _victim(self.rng)
        if victim is not None:
            try:
                os.kill(victim.pid, sig)
            except ProcessLookupError:
                pass

    def _kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _stop(self) -> None:
        self._signal(signal.SIGSTOP)

    def _sigterm(self) -> None:
        self._signal(signal.SIGTERM)

    def _kill_in_checkpoint(self) -> None:
        deadline = time.monotonic() + self.every_s
        while time.monotonic() < deadline and not any(p.name.startswith(".step-") for p in self.folder.iterdir()):
            time.sleep(0.002)
        self._signal(signal.SIGKILL)

    def _node(self) -> None:
        import ray
        from ray._private import ray_constants

        busy = {w.node_id for w in self.cluster.worker_nodes}
        alive = [n for n in self.cluster.worker_nodes if n.node_id in busy]
        if len(alive) <= 1:
            return
        node = self.rng.choice(alive)
        # A lost machine takes every process on it: Cluster.remove_node stops the node's Ray processes,
        # and a worker of it was seen outliving its raylet here (simulated nodes share one host).
        on_node = []
        for info in node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, []):
            try:
                on_node += psutil.Process(info.process.pid).children(recursive=True)
            except psutil.Error:
                pass
        self.cluster.remove_node(node)
        for proc in on_node:
            try:
                proc.kill()
            except psutil.Error:
                pass
        # Cluster.add_node installs a SIGTERM handler (main thread only): not from this thread.
        with mock.patch("ray._private.utils.set_sigterm_handler", lambda handler: None):
            self.added.append(self.cluster.add_node(num_cpus=1))
        ray.nodes()


def run(
    workers: int = 3,
    steps: int = 2000,
    faults: int = 20,
    every_s: float = 15.0,
    seed: int = 0,
    out: Path | None = None,
    shard_optimizer: bool = False,
) -> dict:
    """Fault-free run, then the same run under chaos (both with ``shard_optimizer`` as given); returns the figures."""
    import ray
    from ray.cluster_utils import Cluster

    out = out or Path("benchmarks/out/chaos")
    # No dashboard, no fixed port (a head's default: 8265 for the dashboard, 52365 for its agent): another Ray on
    # the machine may hold them (the other test process's, in tests/test_chaos.py).
    head = {"num_cpus": 0, "include_dashboard": False, "dashboard_port": None, "dashboard_agent_listen_port": 0}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    for _ in range(workers + 1):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR")
    options = dict(
        workers=workers,
        max_steps=steps,
        epochs=10_000,
        batch_size=64,
        checkpoint_every=25,
        progress=False,
        seed=seed,
        optimizer=raympi.optim.sgd(0.05, momentum=0.9),
        max_restarts=faults + 5,
        shard_optimizer=shard_optimizer,
    )  # else fit's defaults
    others = {p.pid for p in worker_processes()}  # an earlier run's in this process: not this run's to count
    try:
        start = time.monotonic()
        clean = raympi.fit(_net(), _data(), checkpoint_dir=str(out / f"clean-{seed}"), **options)
        clean_s = time.monotonic() - start
        folder = out / f"chaos-{seed}"
        folder.mkdir(parents=True, exist_ok=True)
        chaos = Chaos(cluster, folder, faults, every_s, seed)
        chaos.thread.start()
        start, start_wall = time.monotonic(), time.time()
        try:
            result = raympi.fit(_net(), _data(), checkpoint_dir=str(folder), **options)
        finally:
            chaos.stop.set()
            chaos.thread.join()
        chaos_s = time.monotonic() - start
        deadline = time.monotonic() + 60  # killed actors take a moment to go (a stopped one ~5 s)
        while [p for p in worker_processes() if p.pid not in others] and time.monotonic() < deadline:
            time.sleep(0.25)
        left = [p for p in worker_processes() if p.pid not in others]
        left_detail = []
        for p in left:
            try:
                left_detail.append(
                    f"pid {p.pid} {p.status()} {' '.join(p.cmdline())[:60]} age {time.time() - p.create_time():.0f} s"
                )
            except psutil.Error:
                pass
        for p in left:  # a SIGSTOPped process that escaped would hold the run's resources
            p.kill()
    finally:
        ray.shutdown()
        cluster.shutdown()
    diff = max((clean.state.params[k] - result.state.params[k]).abs().max().item() for k in clean.state.params)
    counted = [r for r in result.restarts if r["kind"] in ("worker_lost", "hung", "collective", "formation")]
    recoveries = sorted(r.get("recovery_s", float("nan")) for r in result.restarts)
    return {
        "faults injected": len(chaos.injected),
        "by kind": ", ".join(f for _, f in chaos.injected),
        "restart records": len(result.restarts),
        "failures recovered": len(counted),
        "warm / cold": (
            f"{sum(r['path'] == 'warm' for r in result.restarts)} / {sum(r['path'] == 'cold' for r in result.restarts)}"
        ),
        "spares used": sum(bool(r.get("spare")) for r in result.restarts),
        "steps lost (beyond the step in flight)": sum(max(0, r.get("steps_lost", 0)) for r in result.restarts),
        "steps": (
            f"{len(result.metrics)} of {steps}, "
            f"contiguous: {[r['step'] for r in result.metrics] == list(range(1, steps + 1))}"
        ),
        "throughput vs fault-free": f"{clean_s / chaos_s:.2f} ({steps / chaos_s:.1f} vs {steps / clean_s:.1f} steps/s)",
        "max |param - fault-free param|": f"{diff:.2e}",
        "median recovery_s": f"{recoveries[len(recoveries) // 2] if recoveries else float('nan'):.2f}",
        "worker processes left": len(left),
        "left": left_detail,
        "injected at": [round(t - start_wall, 1) for t, _ in chaos.injected],
        "_diff": diff,
        "_left": len(left),
        "_ratio": clean_s / chaos_s,
        "_contiguous": [r["step"] for r in result.metrics] == list(range(1, steps + 1)),
        "_injected": len(chaos.injected),
        "_records": [
            {
                k: r.get(k)
                for k in ("kind", "path", "step", "restored_step", "steps_lost", "warm_skipped", "spare", "world_after")
            }
            for r in result.restarts
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="about a minute, 4 faults")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: ~5 min of training here)")
    parser.add_argument("--faults", type=int, default=None)
    parser.add_argument("--every", type=float, default=15.0, help="seconds between faults")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-optimizer", action="store_true", help="fit(shard_optimizer=True): sharded state")
    args = parser.parse_args()
    steps = args.steps or (1800 if args.quick else 10000)
    faults = args.faults or (4 if args.quick else 20)
    every = 10.0 if args.quick and args.every == 15.0 else args.every
    figures = run(args.workers, steps, faults, every, args.seed, shard_optimizer=args.shard_optimizer)
    print("| figure | value |\n|---|---|")
    for key, value in figures.items():
        if not key.startswith("_"):
            print(f"| {key} | {value} |")


if __name__ == "__main__":
    main()
