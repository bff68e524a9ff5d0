"""The code passes ``ruff check`` with the project's rules (pyproject.toml), as CI runs it through this test."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is not installed: pip install -e '.[test]' installs it"
    done = subprocess.run([ruff, "check", "--output-format", "concise", "raympi", "tests", "benchmarks", "examples"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
