"""The raympi worker processes of this test run, and only its own.

Two test runs may share the machine (pytest-xdist's workers, or another clone's suite): a check that
"no worker is left" or a kill of "the second rank" must never see the other run's processes.  Every
Ray process started by this run (local instances, simulated clusters' nodes, driver subprocesses)
inherits :data:`RUN_TAG` from the test process, and Ray's workers inherit it from their raylet.
"""

from __future__ import annotations

import os
import time

import psutil

RUN_TAG = "RAYMPI_TEST_RUN"
_tag = os.environ.get(RUN_TAG) or f"{os.getpid()}-{time.time_ns()}"
_xdist = os.environ.get("PYTEST_XDIST_WORKER")  # each of pytest-xdist's workers is a run of its own
os.environ[RUN_TAG] = _tag if not _xdist or _tag.endswith(f"-{_xdist}") else f"{_tag}-{_xdist}"


def _ours(p: psutil.Process) -> bool:
    try:
        return p.environ().get(RUN_TAG) == os.environ[RUN_TAG]
    except (psutil.Error, OSError):
        return False


def workers(title: str = "ray::Worker") -> list[psutil.Process]:
    """Live processes of this run's raympi Worker actors (Ray titles them ``ray::Worker...``; ``title``
    ``"ray::Worker.run"``: those running a chunk of steps now); ``p.info`` holds cmdline, status, create_time."""
    found = []
    for p in psutil.process_iter(["cmdline", "status", "create_time"]):
        cmd = p.info["cmdline"] or []
        if cmd and cmd[0].startswith(title) and p.info["status"] != psutil.STATUS_ZOMBIE and _ours(p):
            found.append(p)
    return found


def training_ranks(least: int = 2, timeout: float = 20.0) -> list[psutil.Process]:
    """The worker processes running steps now, oldest first; waits (up to ``timeout``) until ``least`` of them are.

    Not by start time alone: Ray hands actors worker processes it started ahead (in an earlier test, on a
    shared instance), and an idle hot spare is a worker too; running a chunk tells a rank apart.
    """
    deadline = time.monotonic() + timeout
    while True:
        busy = workers("ray::Worker.run")
        if len(busy) >= least or time.monotonic() > deadline:
            return sorted(busy, key=lambda p: p.info["create_time"])
        time.sleep(0.01)
