"""Where a command's CPU time goes, by kind of process: Ray's workers (by the title they last had), raylets, the GCS,
the dashboard and agents, pytest, torchrun ranks, benchmark scripts, pip...

    python tools/suite_cpu.py -- .venv/bin/python -m pytest -q -p no:cacheprovider
    python tools/suite_cpu.py --quick     # a smoke run: the command is `python -c "import torch"`
    python tools/suite_cpu.py --by RAYMPI_TEST_MODULE -- ...   # and a second table, by that variable

Every process on the machine is sampled from /proc every 0.3 s while the command runs (so run nothing else
meanwhile); a process counts with its user + system time at the last sample that saw it, less what it had used
when sampling began; one that lives under 0.3 s is missed.  Prints the command's exit status, its wall time, the
cores busy on average and a table of the kinds (processes, CPU-s, share, CPU-s per process).  Exits with the
command's status.  ``--by VAR`` adds a table by the value of the environment variable ``VAR`` a process started
with (read once, when it is first seen; the test suite sets ``RAYMPI_TEST_MODULE`` to the module running, and
every process it starts, Ray's workers included, inherits it).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

TICK = os.sysconf("SC_CLK_TCK")
SAMPLE_S = 0.3
UNTITLED = "ray worker (untitled)"
NAMED = (  # a substring of the command line -> its kind, the first that matches
    ("gcs_server", "ray gcs_server"),
    ("dashboard/agent.py", "ray dashboard agent"),
    ("dashboard.py", "ray dashboard"),
    ("runtime_env/agent", "ray runtime_env agent"),
    ("log_monitor", "ray log monitor"),
    ("autoscaler/_private/monitor.py", "ray autoscaler monitor"),
    ("torch.distributed.run", "torchrun"),
    ("mpiexec", "mpiexec"),
    ("mypy", "mypy"),
    ("ruff", "ruff"),
    ("pip", "pip"),
    ("sshd", "sshd"),
    ("pytest", "pytest"),
)


@dataclass
class Seen:
    kind: str
    started: str  # /proc/<pid>/stat's start time: a pid reused by another process is another process
    first_s: float  # CPU time when first seen (what it had used before sampling began, for processes already there)
    last_s: float
    label: str = ""  # the value of --by's variable in its environment ("" without it)


def kind_of(pid: int) -> str | None:
    """The kind of process ``pid`` (None once it is gone); a Ray worker is named by its title (``ray::Worker.run``
    -> ``ray::Worker``), :data:`UNTITLED` while it has none yet."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    if not argv[0]:
        return "kernel"
    if argv[0].startswith("ray::"):
        return "ray::" + re.split(r"[.\s]", argv[0][5:], maxsplit=1)[0]
    if os.path.basename(argv[0]) == "raylet":
        return "ray raylet"
    line = " ".join(argv)
    if "default_worker.py" in line:
        return UNTITLED
    for needle, kind in NAMED:
        if needle in line:
            return kind
    script = re.search(r"(benchmarks|tools)/(\w+\.py)", line)
    if script:
        return f"{script.group(1)}/{script.group(2)}"
    return "python (other)" if "python" in os.path.basename(argv[0]) else os.path.basename(argv[0])


def cpu_s(pid: int) -> tuple[float, str] | None:
    """(user + system seconds, start time) of ``pid``, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICK, fields[19]


def env_value(pid: int, var: str) -> str:
    """``var`` in the environment ``pid`` started with ("-" where it is unset or unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return "-"
    prefix = var.encode() + b"="
    return next((e[len(prefix) :].decode(errors="replace") for e in entries if e.startswith(prefix)), "-")


def sample(seen: dict[int, Seen], first: bool, me: int, by: str | None = None) -> None:
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        now = cpu_s(pid)
        if now is None:
            continue
        entry = seen.get(pid)
        if entry is None or entry.started != now[1]:
            kind = kind_of(pid)
            if kind is not None:
                seen[pid] = Seen(kind, now[1], now[0] if first else 0.0, now[0], env_value(pid, by) if by else "")
            continue
        entry.last_s = now[0]
        if entry.kind.startswith("ray::") or entry.kind == UNTITLED:  # Ray titles a worker by what it runs
            title = kind_of(pid)  # a worker that is exiting has no command line left ("kernel"): not a new title
            if title is not None and title.startswith("ray::") and (title != "ray::IDLE" or entry.kind == UNTITLED):
                entry.kind = title  # an actor's class, once it has had one (not IDLE, the title of a free worker)


def busy_s() -> float:
    """CPU seconds spent by the whole machine so far (all cores; /proc/stat)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:8]]
    return (sum(ticks) - ticks[3] - ticks[4]) / TICK  # less idle and iowait


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help='the command: python -c "import torch"')
    parser.add_argument("--by", metavar="VAR", help="a second table, by this environment variable's value")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="after --: the command to run")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.quick:
        command = [sys.executable, "-c", "import torch"]
    if not command:
        parser.error("give a command after --, or --quick")
    seen: dict[int, Seen] = {}
    me = os.getpid()
    sample(seen, True, me, args.by)
    machine0, start = busy_s(), time.monotonic()
    child = subprocess.Popen(command)
    while child.poll() is None:
        time.sleep(SAMPLE_S)
        sample(seen, False, me, args.by)
    wall, machine = time.monotonic() - start, busy_s() - machine0
    totals = tally(seen, lambda entry: entry.kind)
    counted = sum(cpu for _, cpu in totals.values())
    print(f"\n{' '.join(command)[:100]}: exit {child.returncode}, {wall:.1f} s wall")
    print(f"machine CPU {machine:.1f} s (mean {machine / wall:.2f} cores busy); in the processes below {counted:.1f} s")
    print_table("kind", totals)
    if args.by:
        by_label = tally(seen, lambda entry: entry.label)
        print()
        print_table(args.by, by_label)
        print(f"\nthe kinds that used most CPU, by {args.by} (processes x kind: CPU-s)")
        by_both = tally(seen, lambda entry: (entry.label, entry.kind))
        for label, _ in sorted(by_label.items(), key=lambda kv: -kv[1][1]):
            kinds = sorted(((k, v) for (lab, k), v in by_both.items() if lab == label), key=lambda kv: -kv[1][1])
            print(f"{label:<24} " + ", ".join(f"{int(n)} x {kind}: {c:.0f}" for kind, (n, c) in kinds[:6]))
    return child.returncode


def tally(seen: dict[int, Seen], key: Callable[[Seen], Any]) -> dict[Any, list[float]]:
    """Processes and CPU seconds by ``key``."""
    totals: dict[Any, list[float]] = {}
    for entry in seen.values():
        used = entry.last_s - entry.first_s
        if used > 0:
            count_and_cpu = totals.setdefault(key(entry), [0, 0.0])
            count_and_cpu[0] += 1
            count_and_cpu[1] += used
    return totals


def print_table(title: str, totals: dict[str, list[float]]) -> None:
    counted = sum(cpu for _, cpu in totals.values())
    header = f"{title:<32} | {'procs':>5} | {'CPU s':>8} | {'share':>6} | {'CPU s/proc':>10}"
    print(header + "\n" + "-" * len(header))
    for kind, (n, cpu) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"{kind:<32} | {int(n):>5} | {cpu:>8.1f} | {100 * cpu / counted:>5.1f}% | {cpu / n:>10.2f}")


if __name__ == "__main__":
    sys.exit(main())
