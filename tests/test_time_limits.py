"""The time limits' rule (tests/time_limits.py): a test's declared limit, stretched by the load over the cores."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import time_limits

TESTS = Path(__file__).resolve().parent


def test_the_stretch_is_the_load_over_the_cores_between_1_and_the_ceiling():
    assert time_limits.stretch(0.3, 2) == 1.0  # a quiet machine: the declared limit
    assert time_limits.stretch(2.0, 2) == 1.0  # both test processes busy on 2 cores: still it
    assert time_limits.stretch(5.0, 2) == 2.5  # another job as busy as the suite beside it: 2.5 x
    assert time_limits.stretch(100.0, 2) == time_limits.MAX_STRETCH  # a hang is still caught
    assert time_limits.stretch(5.0, 16) == 1.0


def test_a_cgroup_quota_below_the_affinity_counts(tmp_path, monkeypatch):
    affinity = time_limits.cores() if not time_limits.CPU_MAX.exists() else None
    monkeypatch.setattr(time_limits, "CPU_MAX", tmp_path / "cpu.max")
    (tmp_path / "cpu.max").write_text("max 100000\n")
    n = time_limits.cores()
    assert affinity is None or n == affinity
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a core: counted as 1
    assert time_limits.cores() == 1.0
    (tmp_path / "cpu.max").write_text(f"{int(n * 200000)} 100000\n")  # a quota above the affinity: the affinity
    assert time_limits.cores() == n


def _run_pytest(tmp_path: Path, loads: str, test: str) -> subprocess.CompletedProcess:
    """A one-test pytest run through this suite's hook, the load average read from ``loads``: "A" or "A,B" (A at
    first, B once the test has written the file ``rose``)."""
    (tmp_path / "conftest.py").write_text(
        textwrap.dedent(
            f"""
            import os, sys
            sys.path.insert(0, {str(TESTS)!r})
            import pytest, time_limits

            def fake_load():
                first, _, later = {loads!r}.partition(",")
                rose = os.path.exists(os.path.join({str(tmp_path)!r}, "rose"))
                return (float(later if later and rose else first),) * 3

            os.getloadavg = fake_load
            time_limits.cores = lambda: 2.0

            @pytest.hookimpl(tryfirst=True)
            def pytest_timeout_set_timer(item, settings):
                return time_limits.set_timer(item, settings)
            """
        )
    )
    (tmp_path / "test_it.py").write_text(textwrap.dedent(test))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "test_it.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )


SLEEPS = """
    import time, pytest

    @pytest.mark.timeout(1)
    def test_sleeps():
        time.sleep(0.2)
        open("rose", "w").close()
        time.sleep(1.3)
"""


@pytest.mark.parametrize(
    "loads, passes",
    [
        ("0.5", False),  # quiet: 1 s, and the test takes 1.5 s
        ("4.0", True),  # loaded 2 x from the start: 2 s
        ("0.5,4.0", True),  # loaded since 0.2 s: at 1 s the limit is taken again, 2 s
    ],
)
def test_pytest_timeout_stops_a_test_at_its_stretched_limit(tmp_path, loads, passes):
    done = _run_pytest(tmp_path, loads, SLEEPS)
    assert (done.returncode == 0) is passes, done.stdout + done.stderr
    if not passes:
        assert "Timeout" in done.stdout and "declared 1 s, x1.00 (load 0.50 over 2 cores" in done.stdout, done.stdout


def test_a_hang_is_stopped_at_the_ceiling(tmp_path):
    done = _run_pytest(
        tmp_path,
        "20.0",
        """
        import time, pytest

        @pytest.mark.timeout(0.5)
        def test_hangs():
            time.sleep(30)
        """,
    )
    assert done.returncode == 1 and re.search(r"Timeout \(>2\.\ds\) from pytest-timeout", done.stdout), done.stdout
