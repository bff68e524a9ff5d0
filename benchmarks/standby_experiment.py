"""Experiment: can survivors derive a new communicator from one that holds a dead member, with no new connection?

Issue 22 asks what MPICH 4.3 (UCX and OFI) does when a member of the parent communicator is dead.
This script forms one "standby" communicator of ``--members`` + 1 light Ray actors (no torch) with
raympi's own formation (``Open_port`` / ``Accept`` / ``Connect`` / ``Merge``), derives a training
communicator of the first ``--members`` ranks from it (``MPI_Comm_create_group``), SIGKILLs one
training member in the middle of an allreduce, and then measures, on the survivors and the spare:

    create_group   MPI_Comm_create_group over survivors + spare (collective over the new group only)
    allreduce      a first allreduce on that new communicator (is it poisoned by the dead endpoint?)
    shrink         MPIX_Comm_shrink of the standby communicator (ULFM), where the build has it
    reform         raympi.comm.form over the same actors: the connect path used today

each ``--rounds`` times (a new training member dies each round; a new spare joins the new standby
communicator in between, as in fit: one connect round).  Each timing is the slowest rank's.  A step that fails or
hangs past ``--timeout`` seconds is printed as such.

Run:
    python benchmarks/standby_experiment.py                    # UCX (MPICH's default), 4 members
    python benchmarks/standby_experiment.py --netmod ofi
    python benchmarks/standby_experiment.py --members 8 --rounds 5
    python benchmarks/standby_experiment.py --shrink           # MPIX_Comm_shrink for the new standby
    python benchmarks/standby_experiment.py --sizes 8,16,32,64 # the trend: derive against connect
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import ray  # noqa: E402

from raympi import comm  # noqa: E402
from raympi.comm import library  # noqa: E402
from raympi.driver.config import MPIConfig  # noqa: E402


class Peer(comm.Member):
    """A light member (no torch) that runs the experiment's MPI calls and times them."""

    def __init__(self, env: dict[str, str]) -> None:
        os.environ.update(env)
        self.standby = None  # the communicator of everyone, dead members included
        self.training = None

    def pid(self) -> int:
        return os.getpid()

    def adopt_standby(self) -> int:
        """Take the formed communicator as the standby one (ERRORS_RETURN: a lost peer raises)."""
        MPI = library.init()
        self.standby = self.comm.mpi
        self.standby.Set_errhandler(MPI.ERRORS_RETURN)
        return self.standby.Get_rank()

    def create_training(self, ranks: list[int]) -> float:
        """``MPI_Comm_create_group`` of the standby ranks ``ranks``; the seconds it took here."""
        MPI = library.init()
        started = time.perf_counter()
        group = self.standby.Get_group().Incl(ranks)
        self.training = self.standby.Create_group(group, tag=7)
        self.training.Set_errhandler(MPI.ERRORS_RETURN)
        return time.perf_counter() - started

    def allreduce(self, n: int = 1 << 16, timeout_s: float = 10.0) -> tuple[float, float]:
        """One nonblocking allreduce on the training communicator: (seconds, sum of element 0)."""
        MPI = library.init()
        array = np.ones(n, dtype=np.float32)
        started = time.perf_counter()
        request = self.training.Iallreduce(MPI.IN_PLACE, array, op=MPI.SUM)
        while not request.Test():
            if time.perf_counter() - started > timeout_s:
                comm.communicator.keep_alive(request, array)
                raise TimeoutError("allreduce did not complete")
        return time.perf_counter() - started, float(array[0])

    def allreduce_forever(self) -> str:
        """An allreduce that a peer's death interrupts: what this rank saw."""
        try:
            for _ in range(100000):
                self.allreduce(1 << 16, timeout_s=5.0)
        except Exception as exc:  # noqa: BLE001 - the experiment reports whatever MPI raised
            return f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        return "never interrupted"

    def shrink(self) -> float:
        """MPIX_Comm_shrink of the standby communicator: the seconds it took, the new standby kept."""
        started = time.perf_counter()
        self.standby = self.standby.Shrink()
        return time.perf_counter() - started

    def standby_of(self, ranks: list[int]) -> float:
        """A new standby communicator of ``ranks`` (create_group), replacing the one with the dead member."""
        started = time.perf_counter()
        group = self.standby.Get_group().Incl(ranks)
        self.standby = self.standby.Create_group(group, tag=8)
        return time.perf_counter() - started

    def standby_rank(self) -> int:
        return self.standby.Get_rank()


def outcome(ref: object) -> str:
    """What a finished task gave, or the error that ended it."""
    try:
        return str(ray.get(ref))
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}"


def slowest(refs: list, timeout: float) -> tuple[str, float | None]:
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    if pending:
        return f"HUNG ({len(pending)} of {len(refs)} past {timeout:g} s)", None
    try:
        values = ray.get(refs)
    except Exception as exc:  # noqa: BLE001
        cause = getattr(exc, "cause", exc)
        return f"FAILED: {type(cause).__name__}: {str(cause).splitlines()[0][:100]}", None
    times = [v[0] if isinstance(v, tuple) else v for v in values]
    return "ok", max(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--netmod", choices=["ucx", "ofi"], default="ucx")
    parser.add_argument("--timeout", type=float, default=15.0)
    parser.add_argument(
        "--shrink", action="store_true", help="MPIX_Comm_shrink instead of create_group for the new standby"
    )
    parser.add_argument("--sizes", default="", help="a trend: members per run, e.g. 8,16,32,64 (one round each)")
    args = parser.parse_args()
    env = MPIConfig(netmod=args.netmod).environment(multi_host=False)  # what fit gives its workers
    os.environ.update(env)
    sizes = [int(n) for n in args.sizes.split(",")] if args.sizes else [args.members]
    rounds = 1 if args.sizes else args.rounds
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    trend = []
    for members in sizes:
        rows = experiment(args, members, rounds, env)
        print()
        print(f"{'step':24} {'runs':>4} {'median s':>10} {'max s':>8}")
        for name, values in rows.items():
            print(f"{name:24} {len(values):4d} {statistics.median(values):10.4f} {max(values):8.4f}")
        trend.append((members, rows))
    if len(sizes) > 1:
        print()
        print(f"{'members':>7} | {'derive (create_group) s':>23} | {'connect (form) s':>16} | {'connect/derive':>14}")
        for members, rows in trend:
            derive = statistics.median(rows["create_group"]) if rows.get("create_group") else None
            connect = statistics.median(rows["reform (connect)"]) if rows.get("reform (connect)") else None
            ratio = f"{connect / derive:.0f}x" if derive and connect else "-"
            print(
                f"{members:>7} | {derive if derive is not None else float('nan'):>23.4f} | "
                f"{connect if connect is not None else float('nan'):>16.4f} | {ratio:>14}"
            )
    ray.shutdown()


def experiment(args: argparse.Namespace, n: int, rounds: int, env: dict[str, str]) -> dict[str, list[float]]:
    """Form a standby communicator of ``n`` members + 1 spare, then ``rounds`` rounds of kill / derive / reform."""
    print(f"MPI: {library.library_version()}; {env}; {n} members + 1 spare")
    Actor = ray.remote(num_cpus=0.01, max_restarts=0)(Peer)
    actors = [Actor.remote(env) for _ in range(n + 1)]
    started = time.perf_counter()
    comm.form(actors, timeout_s=max(60.0, 6.0 * n))  # one connect round per member: 39 s for 32 on 2 cores
    print(f"standby formed: {time.perf_counter() - started:.3f} s")
    ray.get([a.adopt_standby.remote() for a in actors])
    pids = ray.get([a.pid.remote() for a in actors])
    rows: dict[str, list[float]] = {}
    members = list(range(n))  # standby ranks of the training members
    status, s = slowest([a.create_training.remote(members) for a in actors[:n]], args.timeout)
    print(f"training communicator derived: {status} {s}")
    for round_ in range(rounds):
        standby_size = len(actors)
        spare = standby_size - 1  # the spare is the last standby rank
        victim = members[round_ % len(members)]
        inflight = [actors[r].allreduce_forever.remote() for r in members]
        time.sleep(0.3)
        os.kill(pids[victim], signal.SIGKILL)
        survivors = [r for r in members if r != victim]
        seen = ray.wait([inflight[members.index(r)] for r in survivors], num_returns=len(survivors), timeout=10)
        print(
            f"round {round_}: killed standby rank {victim}; survivors' allreduce ended: "
            f"{[outcome(x) for x in seen[0]]}, still blocked: {len(seen[1])}"
        )
        new_members = survivors + [spare]
        who = [actors[r] for r in new_members]
        status, s = slowest([a.create_training.remote(new_members) for a in who], args.timeout)
        print(f"  create_group over {len(new_members)} (dead rank excluded): {status} {s}")
        if s is not None:
            rows.setdefault("create_group", []).append(s)
            status, s = slowest([a.allreduce.remote() for a in who], args.timeout)
            sums = ray.get([a.allreduce.remote() for a in who]) if s is not None else []
            print(f"  first allreduce on it: {status} {s} sums {[v for _, v in sums]}")
            if s is not None:
                rows.setdefault("allreduce", []).append(s)
        alive = [r for r in range(standby_size) if r != victim]
        if args.shrink:  # it blocks the actors that call it when it hangs: nothing else can be tried after
            status, s = slowest([actors[r].shrink.remote() for r in alive], args.timeout)
            print(f"  MPIX_Comm_shrink of the standby: {status} {s}")
        else:
            status, s = slowest([actors[r].standby_of.remote(alive) for r in alive], args.timeout)
            print(f"  create_group of a new standby without the dead rank: {status} {s}")
        if s is None:
            print("  no standby communicator without the dead member: stopping")
            break
        rows.setdefault("new standby", []).append(s)
        started = time.perf_counter()
        fresh = Actor.remote(env)  # as fit does: the new spare opens a port, the standby members connect to it
        port = ray.get(fresh.mpi_open_port.remote())
        status, s = slowest(
            [actors[r].mpi_join_standby.remote(port, False) for r in alive]
            + [fresh.mpi_join_standby.remote(port, True)],
            args.timeout,
        )
        rows.setdefault("spare joins standby", []).append(time.perf_counter() - started)
        print(f"  a new spare joined the standby: {status} {time.perf_counter() - started:.3f} s")
        actors = [actors[r] for r in alive] + [fresh]
        pids = [pids[r] for r in alive] + [ray.get(fresh.pid.remote())]
        ranks = ray.get([a.standby_rank.remote() for a in actors])
        assert ranks == list(range(len(actors))), ranks
        members = [alive.index(r) for r in new_members]
        status, s = slowest([actors[r].create_training.remote(members) for r in members], args.timeout)
        print(f"  training re-derived from the new standby: {status} {s}")
        # The connect path of today, for comparison: a new communicator of the same members.
        started = time.perf_counter()
        try:
            comm.form([actors[r] for r in members], timeout_s=max(args.timeout, 3.0 * n))
            rows.setdefault("reform (connect)", []).append(time.perf_counter() - started)
            print(f"  raympi.comm.form over the same {len(members)}: {time.perf_counter() - started:.3f} s")
        except Exception as exc:  # noqa: BLE001
            print(f"  raympi.comm.form: FAILED {exc}")
            break
    for a in actors:
        ray.kill(a, no_restart=True)
    return rows


if __name__ == "__main__":
    main()
