"""The code passes ``ruff check`` with the project's rules, ``ruff format --check``, and ``mypy`` (strict on
the whole package: core, comm, driver and worker), all configured in pyproject.toml, as CI runs them through
these tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is not installed: pip install -e '.[test]' installs it"
    done = subprocess.run(
        [ruff, "check", "--output-format", "concise", "raympi", "tests", "benchmarks", "tools", "examples", "docs"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow  # a cold mypy (no .mypy_cache) reads torch's stubs: up to a minute of CPU
def test_mypy_strict_on_the_whole_package():
    mypy = shutil.which("mypy", path=str(Path(sys.executable).parent)) or shutil.which("mypy")
    assert mypy, "mypy is not installed: pip install -e '.[test]' installs it"
    # No arguments: pyproject.toml's [tool.mypy] names the files (all of raympi/) and the strict settings.
    done = subprocess.run([mypy], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format_is_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is not installed: pip install -e '.[test]' installs it"
    done = subprocess.run(
        [ruff, "format", "--check", "raympi", "tests", "benchmarks", "tools", "examples", "docs"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
