"""Time limits that follow the machine's load: each test's pytest-timeout limit, stretched (tests/conftest.py).

A test declares the limit it needs on 2 quiet cores with both test processes of the README's command busy
(``@pytest.mark.timeout(s)``, else ``timeout`` in pyproject.toml): a few times what it takes there.  Beside other jobs
its processes get a share of the cores and its work takes longer in proportion, so its limit is stretched in
proportion::

    limit = declared x stretch,   stretch = min(MAX_STRETCH, max(1, load / cores))

``load``: the 1-minute load average (the processes running or waiting for a core, as ``uptime`` shows it);
``cores``: those this process may run on (its CPU affinity, fewer where a cgroup v2 quota says so).  The stretch is
taken when the test starts and again whenever its limit runs out, so a job that started beside it since counts too:
the test fails the first time it has run longer than its declared limit times the load then.  A hang never ends, so
it is still caught, after at most ``MAX_STRETCH`` times its declared limit.  The suite's own processes count in the
load as well (two busy test processes on 2 cores: about x1, more while Ray starts a cluster's processes), which only
lengthens the wait for a hang.  The same rule serves a deadline inside a test that stands for the test's work (a
subprocess's ``timeout=``): :func:`limit_s`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

MAX_STRETCH = 4.0  # a hang is caught within 4 x its declared limit, however loaded the machine
CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" in microseconds, or "max <period>"


def cores() -> float:
    """The cores this process may run on: its CPU affinity, or its cgroup's CPU quota where that is fewer."""
    n = float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    try:
        quota, period = CPU_MAX.read_text().split()
        if quota != "max":
            n = min(n, max(1.0, int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return n


def load() -> float:
    """The 1-minute load average; 0 where the system keeps none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def stretch(load_now: float | None = None, n_cores: float | None = None) -> float:
    """How many times its declared limit a test gets now: the load over the cores, at least 1, at most MAX_STRETCH."""
    load_now = load() if load_now is None else load_now
    n_cores = cores() if n_cores is None else n_cores
    return min(MAX_STRETCH, max(1.0, load_now / n_cores))


def limit_s(declared_s: float) -> float:
    """``declared_s`` stretched by the load now."""
    return declared_s * stretch()


def describe() -> str:
    return f"x{stretch():.2f} (load {load():.2f} over {cores():g} cores, at most x{MAX_STRETCH:g})"


def set_timer(item, settings) -> bool:
    """pytest-timeout's timer for ``item`` (its ``pytest_timeout_set_timer`` hook), the limit stretched.

    With pytest-timeout's signal method (the default, in the main thread) the stretch is taken again each time the
    timer runs out; with its thread method, once, at the start."""
    import pytest_timeout

    declared, start = settings.timeout, time.monotonic()
    first = limit_s(declared)
    item.add_report_section("setup", "time limit", f"declared {declared:g} s, {describe()}: {first:.0f} s")
    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return pytest_timeout.pytest_timeout_set_timer(item, settings._replace(timeout=first))

    def expired(signum, frame) -> None:
        __tracebackhide__ = True
        ran = time.monotonic() - start
        left = limit_s(declared) - ran
        if left > 0.1:  # the load rose since the timer was set: the limit with it
            item.add_report_section("call", "time limit", f"at {ran:.0f} s, {describe()}: {left:.0f} s more")
            signal.setitimer(signal.ITIMER_REAL, left)
            return
        pytest_timeout.timeout_sigalrm(item, settings._replace(timeout=round(ran, 1)))

    def cancel() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)

    item.cancel_timeout = cancel  # what pytest-timeout's pytest_timeout_cancel_timer calls
    signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, first)
    return True
