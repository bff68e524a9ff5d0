"""Does a survivor survive its peer's death?  Kill trials under several MPI transport settings.

A warm restart needs the ranks that did not fail to live through the failure of a peer: they abandon
the collective in flight (``Communicator.abort``) and re-form with a replacement.  Under MPICH's UCX
netmod on one host, a survivor could die with its peer: UCX's shared-memory CMA transport reads the
peer's memory with ``process_vm_readv``, which fails with ESRCH once the peer is gone, and MPICH
creates its UCX endpoints without peer-failure handling, so UCX treats that as fatal and aborts the
survivor (``cma_ep.c:85 process_vm_readv(...) returned -1: No such process``, then SIGABRT).

One trial, per setting (2 ranks by default, ``--ranks 3`` for 3; one MPI communicator of Ray actors):

  1. every rank loops ``Communicator.allreduce_`` of a 23.3 MB float32 buffer (the 5.8M-parameter
     MLP's gradients, two 16 MiB buckets) and four of 4 KB, timing each call;
  2. after a random 0.2-1.2 s the last rank (the newest member) is SIGKILLed;
  3. once its process is gone (+0.5 s, about when Ray tells raympi's driver) the survivors are asked
     to abort (``comm.abort.set()`` from a method of the "health" concurrency group, as
     ``raympi.worker.Worker.abort`` does);
  4. each survivor must return from the abandoned loop, stay alive, answer a call within 5 s, then
     re-form a communicator with a fresh actor (survivors first, as the warm path does) and sum a
     small tensor correctly with it.  Any MPI progress after the death (forming included) can still
     advance the abandoned transfer, so the re-formation is part of the check.
The replacement is the next trial's victim, so each survivor lives through every trial of its
setting, as it would through repeated failures of a long run.  Outcomes:

  survivor crash   a survivor process died by itself; its Ray worker logs (``worker-*-<pid>.err`` /
                   ``.out``, ``python-core-worker-*_<pid>.log``) and Ray's error are grepped for the
                   cause, and the next trial starts from fresh actors;
  other failure    every survivor lived, but did not leave the abandoned collective within 5 s (its
                   stacks are dumped with py-spy to benchmarks/out/survivors_stuck_*.txt), or the
                   re-formation hung past 45 s: either way a warm restart would not have happened;
  excluded         a survivor stopped by SIGTERM/SIGINT from another process (another job's
                   ``ray stop`` on a shared machine): shown, not counted.

Settings run interleaved (trial 1 of every setting, then trial 2, ...) in one Ray instance, each
setting's actors with their own environment, so the per-step costs (median ms of one allreduce_ of
23.3 MB and of 4 KB, over the survivors' loops of all trials) share the machine's load.

    python benchmarks/survivors.py                         # 30 trials of 5 settings (~15-25 min on 2 cores)
    python benchmarks/survivors.py --settings "default,ucx (before)" --trials 30
    python benchmarks/survivors.py --ranks 3 --settings "default,default +eagain"
    python benchmarks/survivors.py --quick                 # 2 trials, raympi's default only (tests)

``default`` is whatever ``raympi.MPIConfig().environment(multi_host=False)`` gives now; the
others are fixed environments (``--list`` prints them); a name may end with experiment options
(``+preconnect``, ``+eagain``: see OPTIONS).  benchmarks/out/survivors.csv has every trial
(survivors_quick.csv with --quick), rewritten after every round.
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import psutil  # noqa: E402
import ray  # noqa: E402
import ray._private.worker  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raympi import MPIConfig, comm  # noqa: E402
from raympi.exceptions import CollectiveAborted  # noqa: E402

from _common import start_local_ray, write_csv  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
BIG_NUMEL = 5_820_000  # 23.3 MB of float32: the 784-2048-2048-10 MLP's gradients
SMALL_NUMEL = 1024  # 4 KB
SMALL_PER_BIG = 4
KILL_AFTER_S = (0.2, 1.2)
ABORT_DELAY_S = 0.5
ANSWER_S = 5.0
LATE_WAIT_S = (
    120.0  # how long a survivor late to leave its abandoned collective is waited for (to tell slow from stuck)
)
REFORM_TIMEOUT_S = 45.0  # re-forming takes well under a second (a few under heavy load): longer is a hang

# name -> environment of every rank (on top of OMP_NUM_THREADS=1).  "default" is computed at run time.
SETTINGS: dict[str, dict[str, str]] = {
    "ucx (before)": {"MPIR_CVAR_CH4_NETMOD": "ucx"},
    "ucx ^cma": {"MPIR_CVAR_CH4_NETMOD": "ucx", "UCX_TLS": "^cma"},
    "ucx self+posix": {"MPIR_CVAR_CH4_NETMOD": "ucx", "UCX_TLS": "self,posix"},
    "ucx rndv am": {"MPIR_CVAR_CH4_NETMOD": "ucx", "UCX_RNDV_SCHEME": "am"},
    "ofi tcp": {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"},
    "ofi rxm": {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp;ofi_rxm"},
    "ofi sockets": {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "sockets"},
}
DEFAULT_SETTINGS = ["default", "ucx (before)", "ucx ^cma", "ucx self+posix", "ucx rndv am"]

# Lines of a dead worker's logs that say why it died, most telling first.
CAUSES = [
    re.compile(r"\S+\.c:\d+\s+.*(?:returned -1|failed|error).*", re.I),  # UCX: "[host:pid:0:tid] cma_ep.c:85 ..."
    re.compile(r".*(?:ucs_fatal|Fatal error|Assertion .* failed).*"),
    re.compile(r".*\*\*\* (?:SIG\w+) received.*"),
    re.compile(r"Fatal Python error: .*"),
    re.compile(r".*(?:Abort|Segmentation fault|Bus error).*"),
]


# Options a setting's name may end with (" +preconnect +eagain"), experiments on top of its environment:
#   preconnect  every pair of ranks exchanges a message right after formation (no connection set up later, lazily)
#   eagain      the communicator carries MPICH's "MPI_OFI_set_eagain" hint and MPIR_CVAR_CH4_OFI_MAX_EAGAIN_RETRY
#               is set, so an OFI operation that keeps failing with EAGAIN (a dead peer) returns an error
#               instead of retrying inside MPI_Test for ever
OPTIONS = ("preconnect", "eagain")
EAGAIN_RETRIES = "100000"


def split(setting: str) -> tuple[str, set[str]]:
    base, *options = setting.split(" +")
    return base, set(options)


def environment(setting: str) -> dict[str, str]:
    base, options = split(setting)
    env = MPIConfig().environment(multi_host=False) if base == "default" else SETTINGS[base]
    extra = {"MPIR_CVAR_CH4_OFI_MAX_EAGAIN_RETRY": EAGAIN_RETRIES} if "eagain" in options else {}
    return {"OMP_NUM_THREADS": "1", **env, **extra}


@ray.remote(num_cpus=0, concurrency_groups={"health": 1})
class Rank(comm.Member):
    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="health")
    def ping(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="health")
    def abort(self) -> None:
        if self.comm is not None:
            self.comm.abort.set()

    def check(self, options: set[str] = frozenset()) -> float:
        """One small allreduce on a freshly formed communicator: returns the sum (the world size).

        ``options``: see OPTIONS.
        """
        from raympi.comm import library

        MPI = library.require()
        self.comm.mpi.Set_errhandler(MPI.ERRORS_RETURN)
        if "eagain" in options:
            info = MPI.Info.Create()
            info.Set("MPI_OFI_set_eagain", "true")
            self.comm.mpi.Set_info(info)
            info.Free()
        if "preconnect" in options:
            rank, size = self.comm.rank, self.comm.size
            for offset in range(1, size):
                self.comm.mpi.sendrecv(rank, dest=(rank + offset) % size, source=(rank - offset) % size)
        x = torch.ones(SMALL_NUMEL)
        self.comm.allreduce_([x])
        return float(x[0])

    def spin(self, max_s: float) -> dict[str, Any]:
        """allreduce_ 23.3 MB and 4 KB in a loop until aborted (or an MPI error, or ``max_s``)."""
        from raympi.comm import library

        torch.set_num_threads(1)
        self.comm.mpi.Set_errhandler(library.require().ERRORS_RETURN)  # as raympi's workers: a lost peer raises
        big, small = torch.zeros(BIG_NUMEL), torch.zeros(SMALL_NUMEL)
        times: dict[str, list[float]] = {"big": [], "small": []}
        end, how = time.monotonic() + max_s, "timeout"
        try:
            while time.monotonic() < end:
                start = time.perf_counter()
                self.comm.allreduce_([big])
                times["big"].append(time.perf_counter() - start)
                for _ in range(SMALL_PER_BIG):
                    start = time.perf_counter()
                    self.comm.allreduce_([small])
                    times["small"].append(time.perf_counter() - start)
        except CollectiveAborted:
            how = "aborted"
        except Exception as exc:  # MPI reported the lost peer (ERRORS_RETURN)
            how = f"mpi error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        # The first calls of a new communicator set up connections: not a step's cost.
        return {"how": how, "big": times["big"][2:], "small": times["small"][2 * SMALL_PER_BIG :]}


class Chain:
    """The actors of one setting: the survivors, and the newest member (the next victim)."""

    def __init__(self, setting: str, ranks: int) -> None:
        self.setting, self.ranks = setting, ranks
        self.env = environment(setting)
        self.options = split(setting)[1]
        self.members: list[Any] = []
        self.pids: list[int] = []
        self.big: list[float] = []
        self.small: list[float] = []
        self.trials: list[dict[str, Any]] = []

    def new_actor(self) -> Any:
        return Rank.options(runtime_env={"env_vars": self.env}).remote()

    def fill(self) -> None:
        """Bring the group to ``ranks`` members (fresh actors last) and form it."""
        fresh = [self.new_actor() for _ in range(self.ranks - len(self.members))]
        ray.get([a.pid.remote() for a in fresh], timeout=180)
        self.members += fresh
        comm.form(self.members, timeout_s=120)
        self.pids = ray.get([a.pid.remote() for a in self.members], timeout=30)
        sums = ray.get([a.check.remote(self.options) for a in self.members], timeout=30)
        assert all(s == self.ranks for s in sums), sums

    def reset(self) -> None:
        for a in self.members:
            ray.kill(a, no_restart=True)
        self.members, self.pids = [], []


def cause_of(pid: int, logs: Path, error: str = "") -> str:
    """The line of a dead worker's Ray logs (or of the error Ray raised for it) that says why it died."""
    files = [
        f
        for pattern in (f"worker-*-{pid}.err", f"worker-*-{pid}.out", f"python-core-worker-*_{pid}.log")
        for f in glob.glob(str(logs / pattern))
    ]
    text = []
    for f in files:
        try:
            text += Path(f).read_text(errors="replace").splitlines()
        except OSError:
            pass
    text += error.splitlines()
    for pattern in CAUSES:
        for line in text:
            if pattern.fullmatch(line.strip()) or pattern.search(line):
                return re.sub(r"\s+", " ", line.strip())[:200]
    return f"no cause found in {len(files)} log file(s) of pid {pid}"


def _stacks(pids: list[int], tag: str) -> Path:
    """Native and Python stacks of ``pids`` (py-spy), written to benchmarks/out/survivors_stuck_<tag>.txt."""
    dumps = []
    spy = Path(sys.executable).with_name("py-spy")
    for pid in pids:
        try:
            out = subprocess.run(
                [str(spy), "dump", "--native", "--pid", str(pid)], capture_output=True, text=True, timeout=60
            )
            dumps.append(f"== pid {pid}\n{out.stdout}{out.stderr}")
        except (OSError, subprocess.SubprocessError) as exc:
            dumps.append(f"== pid {pid}: no py-spy dump ({exc})")
    OUT.mkdir(exist_ok=True)
    path = OUT / f"survivors_stuck_{re.sub(r'[^A-Za-z0-9]+', '_', tag)}.txt"
    path.write_text("\n".join(dumps))
    print(f"  stacks of a stuck stage: {path}", flush=True)
    return path


def _late(runs: list[Any], pids: list[int], since: float, tag: str) -> str:
    """A survivor that did not leave its abandoned collective in time: its stacks (py-spy), then slow or stuck?"""
    path = _stacks(pids, tag)
    while time.monotonic() - since < LATE_WAIT_S:
        ready, _ = ray.wait(runs, num_returns=len(runs), timeout=0.5)
        if len(ready) == len(runs):
            return f"returned {time.monotonic() - since:.1f} s after the abort; stacks at {ANSWER_S:.0f} s: {path}"
    return f"still in the collective {time.monotonic() - since:.0f} s after the abort; stacks: {path}"


def _core_log_says(pid: int, logs: Path, text: str) -> bool:
    for f in glob.glob(str(logs / f"python-core-worker-*_{pid}.log")):
        try:
            if text in Path(f).read_text(errors="replace"):
                return True
        except OSError:
            pass
    return False


def _killed_by_us(pid: int, logs: Path) -> bool:
    """Whether the process exited on ray.kill (after its group failed to form), as its core-worker log says."""
    return _core_log_says(pid, logs, "Force kill actor request")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def trial(chain: Chain, logs: Path, rng: random.Random) -> dict[str, Any]:
    """One kill trial; returns its record (``crash`` is None when every survivor survived)."""
    record: dict[str, Any] = {"setting": chain.setting, "trial": len(chain.trials) + 1, "crash": None, "cause": ""}
    try:
        if len(chain.members) < chain.ranks:
            chain.fill()
    except Exception as exc:  # a fresh group that cannot form is not a survivor crash; say so and retry later
        chain.reset()
        record.update(crash=None, setup_error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        return record
    started = time.monotonic()
    survivors, victim = chain.members[:-1], chain.members[-1]
    survivor_pids, victim_pid = chain.pids[:-1], chain.pids[-1]
    runs = [a.spin.remote(60.0) for a in chain.members]
    kill_after = rng.uniform(*KILL_AFTER_S)
    time.sleep(kill_after)
    os.kill(victim_pid, signal.SIGKILL)  # our own actor's process
    record["kill_after_s"] = round(kill_after, 3)
    deadline = time.monotonic() + 10
    while not _gone(victim_pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    replacement = chain.new_actor()  # starts while the survivors wait for their abort
    time.sleep(ABORT_DELAY_S)
    stage = "abort"
    try:
        ray.get([a.abort.remote() for a in survivors], timeout=ANSWER_S)
        stage = "abandoning the collective"
        aborted_at = time.monotonic()
        try:
            results = ray.get(runs[:-1], timeout=ANSWER_S)
        except ray.exceptions.GetTimeoutError:
            record["late"] = _late(runs[:-1], survivor_pids, aborted_at, f"{chain.setting}-{record['trial']}")
            raise
        record["how"] = ";".join(sorted({r["how"] for r in results}))
        for r in results:
            chain.big += r["big"]
            chain.small += r["small"]
        stage = "answering"
        if ray.get([a.ping.remote() for a in survivors], timeout=ANSWER_S) != survivor_pids:
            raise RuntimeError("a survivor answered with another pid")
        if any(_gone(p) for p in survivor_pids):
            raise RuntimeError("a survivor process is gone")
        stage = "re-forming"
        fresh_pid = ray.get(replacement.pid.remote(), timeout=180)
        ray.kill(victim, no_restart=True)
        chain.members = [*survivors, replacement]
        # A hang is killed by form() at its deadline: take the members' stacks shortly before.
        spy = threading.Timer(
            REFORM_TIMEOUT_S - 10, _stacks, ([*survivor_pids, fresh_pid], f"reform-{chain.setting}-{record['trial']}")
        )
        spy.start()
        try:
            comm.form(chain.members, timeout_s=REFORM_TIMEOUT_S)
        finally:
            spy.cancel()
        stage = "first allreduce after re-forming"
        chain.pids = ray.get([a.pid.remote() for a in chain.members], timeout=30)
        sums = ray.get([a.check.remote(chain.options) for a in chain.members], timeout=30)
        if any(s != chain.ranks for s in sums):
            raise RuntimeError(f"wrong sums after re-forming: {sums}")
    except Exception as exc:
        time.sleep(1.0)  # let a dying process's logs reach the disk
        died = [p for p in survivor_pids if _gone(p) and not _killed_by_us(p, logs)]
        message = str(exc).strip().splitlines()[0][:240] if str(exc).strip() else ""
        if died and all(_core_log_says(p, logs, "Worker exits by a signal") for p in died):
            # SIGTERM/SIGINT from outside (another job's `ray stop`, say): not this trial's doing; excluded
            record["external"] = f"{stage}: survivor pid(s) {died} stopped by a signal from another process"
        elif died:
            record["crash"] = f"{stage}: {type(exc).__name__}"
            record["cause"] = cause_of(died[0], logs, str(exc))
        else:  # every survivor lived (form() kills the members of a group that failed to form)
            record["failure"] = f"{stage}: {type(exc).__name__}: {message}" + (
                f" ({record['late']})" if "late" in record else ""
            )
        ray.kill(replacement, no_restart=True)
        chain.reset()
    record["trial_s"] = round(time.monotonic() - started, 1)
    return record


def save_trials(path: Path, chains: list[Chain]) -> None:
    fields = [
        "setting",
        "trial",
        "kill_after_s",
        "how",
        "crash",
        "cause",
        "failure",
        "external",
        "setup_error",
        "trial_s",
    ]
    write_csv(path, (r for c in chains for r in c.trials), fields, extrasaction="ignore")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--ranks", type=int, default=2, choices=(2, 3))
    parser.add_argument(
        "--settings", default=",".join(DEFAULT_SETTINGS), help=f"comma-separated, of: default, {', '.join(SETTINGS)}"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="2 trials of the default setting")
    parser.add_argument("--list", action="store_true", help="print the settings' environments and exit")
    args = parser.parse_args()
    if args.quick:  # (a re-formation hang, about 1 in 10-30, then costs the test suite 15 s, not 45)
        global REFORM_TIMEOUT_S
        args.trials, args.settings, REFORM_TIMEOUT_S = 2, "default", 15.0
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    for s in settings:
        base, options = split(s)
        if base != "default" and base not in SETTINGS or options - set(OPTIONS):
            parser.error(
                f"unknown setting {s!r}; known: default, {', '.join(SETTINGS)}, each with any of "
                f"{', '.join(' +' + o for o in OPTIONS)}"
            )
    if args.list:
        for s in ["default", *SETTINGS]:
            print(f"{s:<16} {environment(s)}")
        return

    rng = random.Random(args.seed)
    start_local_ray(2, log_to_driver=False)
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    chains = [Chain(s, args.ranks) for s in settings]
    path = OUT / ("survivors_quick.csv" if args.quick else "survivors.csv")
    started = time.monotonic()
    try:
        for t in range(args.trials):
            for chain in chains:
                while True:
                    rec = trial(chain, logs, rng)
                    if "setup_error" not in rec or sum("setup_error" in r for r in chain.trials) >= 3:
                        break
                    chain.trials.append(rec)  # counted, shown, and retried (a group that never formed saw no kill)
                    print(f"  {chain.setting}: could not form a group ({rec['setup_error']}); retrying", flush=True)
                chain.trials.append(rec)
                if rec["crash"]:
                    print(
                        f"  {chain.setting} trial {rec['trial']}: SURVIVOR CRASHED at {rec['crash']}: {rec['cause']}",
                        flush=True,
                    )
                elif rec.get("external"):
                    print(f"  {chain.setting} trial {rec['trial']}: excluded, {rec['external']}", flush=True)
                elif rec.get("failure"):
                    print(
                        f"  {chain.setting} trial {rec['trial']}: survivor alive, but failed at {rec['failure']}",
                        flush=True,
                    )
            save_trials(path, chains)  # after every round: a run stopped from outside keeps what it measured
            print(f"trial {t + 1}/{args.trials} done ({time.monotonic() - started:.0f} s)", flush=True)
    finally:
        ray.shutdown()

    print(
        f"\n{args.ranks} ranks, one host; the last rank SIGKILLed at a random moment of an allreduce_ loop, "
        f"survivors aborted {ABORT_DELAY_S} s after its death, then re-formed with a fresh rank"
    )
    head = (
        f"{'setting':<22} | {'trials':>6} | {'survivor crashes':>16} | {'other failures':>14} | "
        f"{'23.3 MB ms':>10} | {'4 KB ms':>8} | environment"
    )
    print(head)
    print("-" * len(head))
    for chain in chains:
        done = [r for r in chain.trials if "setup_error" not in r and "external" not in r]
        crashes = sum(1 for r in done if r["crash"])
        failures = sum(1 for r in done if r.get("failure"))
        big = f"{statistics.median(chain.big) * 1e3:.2f}" if chain.big else "-"
        small = f"{statistics.median(chain.small) * 1e3:.3f}" if chain.small else "-"
        env = " ".join(f"{k}={v}" for k, v in chain.env.items() if k != "OMP_NUM_THREADS")
        print(f"{chain.setting:<22} | {len(done):>6} | {crashes:>16} | {failures:>14} | {big:>10} | {small:>8} | {env}")
    causes = [(c.setting, r) for c in chains for r in c.trials if r["crash"]]
    if causes:
        print("\ncrashed survivors (stage: error; the cause, from the survivor's Ray worker logs):")
        for setting, r in causes:
            print(f"  {setting} trial {r['trial']}: {r['crash']}; {r['cause']}")
    failed = [(c.setting, r) for c in chains for r in c.trials if r.get("failure")]
    if failed:
        print("\nfailures with every survivor alive (stage: error):")
        for setting, r in failed:
            print(f"  {setting} trial {r['trial']}: {r['failure']}")
    for setting, r in [(c.setting, r) for c in chains for r in c.trials if "external" in r]:
        print(f"  excluded: {setting} trial {r['trial']}: {r['external']}")
    setup = [(c.setting, r) for c in chains for r in c.trials if "setup_error" in r]
    for setting, r in setup:
        print(f"  {setting}: a group did not form ({r['setup_error']})")
    print(f"\nevery trial: {path}")


if __name__ == "__main__":
    main()
