"""The MPI library checks: a broken or missing MPI gives one readable line, and doctor works."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

FAKE_RC = "class _RC:\n    initialize = True\n    finalize = None\nrc = _RC()\n"
FAKES = {
    # A library that cannot be installed here alongside the real one: MPICH 5.0.x.
    "mpich5": "def Get_library_version():\n    return 'MPICH Version:      5.0.1\\nMPICH Release date: 2026\\n'\n",
    "missing": "raise ImportError('libmpi.so.12: cannot open shared object file')\n",
}


def _run(args, fake, tmp_path):
    env = dict(os.environ)
    if fake:
        pkg = tmp_path / "mpi4py"
        pkg.mkdir(exist_ok=True)
        (pkg / "__init__.py").write_text(FAKE_RC)
        (pkg / "MPI.py").write_text(FAKES[fake])
        env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)


@pytest.mark.parametrize("fake, words", [("mpich5", ["MPICH 5", "mpich>=4.3,<5", "7805"]), ("missing", ["no usable MPI library", "pip install"])])
def test_import_and_doctor_explain_a_bad_mpi(tmp_path, fake, words):
    imported = _run(["-c", "import raympi"], fake, tmp_path)
    assert imported.returncode != 0
    last = imported.stderr.strip().splitlines()[-1]
    assert last.startswith("raympi.exceptions.MPIUnavailableError: ")
    assert all(w in last for w in words), last

    doctor = _run(["-m", "raympi", "doctor"], fake, tmp_path)
    assert doctor.returncode == 1
    fail = [line for line in doctor.stdout.splitlines() if line.startswith("FAIL: ")]
    assert len(fail) == 1 and all(w in fail[0] for w in words), doctor.stdout


def test_forming_with_a_broken_mpi_is_refused(monkeypatch):
    from raympi import _mpi, comm
    from raympi.exceptions import FormationError

    monkeypatch.setattr(_mpi, "library_version", lambda: "MPICH Version:      5.0.0")
    with pytest.raises(FormationError, match="4.3 series"):
        comm.form([object()], timeout_s=5)


def test_doctor_on_the_real_library(tmp_path):
    done = _run(["-m", "raympi", "doctor"], None, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "MPICH Version:      4.3" in done.stdout
    assert "connect  ok" in done.stdout
    for dist in ("ray", "torch", "mpi4py"):
        assert any(line.startswith(dist + " ") for line in done.stdout.splitlines())
