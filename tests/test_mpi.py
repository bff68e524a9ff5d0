"""The MPI library checks: a broken or missing MPI gives one readable line, and doctor works."""

from __future__ import annotations

import os
import subprocess
import sys

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


_USE_CORE = (
    "import raympi, torch\n"
    "opt = raympi.optim.adam(1e-3)\n"
    "model = torch.nn.Linear(3, 2)\n"
    "state = raympi.TrainState.create(model, opt)\n"
    "step = raympi.make_train_step(model, torch.nn.functional.cross_entropy, opt)\n"
    "state, m = step(state, (torch.randn(4, 3), torch.tensor([0, 1, 0, 1])))\n"
    "assert int(state.step) == 1 and m['loss'] > 0\n"
    "import sys; assert 'ray' not in sys.modules, 'import raympi must not import Ray'\n"
    "print('core ok')\n"
)
_FIT = (
    "import raympi, torch\n"
    "raympi.fit(torch.nn.Linear(3, 2), (torch.randn(8, 3), torch.zeros(8, dtype=torch.long)), batch_size=4)\n"
)


@pytest.mark.parametrize(
    "fake, words",
    [("mpich5", ["MPICH 5", "mpich>=4.3,<5", "7805"]), ("missing", ["no usable MPI library", "pip install"])],
)
def test_core_works_without_mpi_and_fit_explains_it(tmp_path, fake, words):
    core = _run(["-c", _USE_CORE], fake, tmp_path)
    assert core.returncode == 0 and "core ok" in core.stdout, core.stderr[-2000:]

    fitted = _run(["-c", _FIT], fake, tmp_path)
    assert fitted.returncode != 0
    last = fitted.stderr.strip().splitlines()[-1]
    assert last.startswith("raympi.exceptions.MPIUnavailableError: ")
    assert all(w in last for w in words), last

    doctor = _run(["-m", "raympi", "doctor"], fake, tmp_path)
    assert doctor.returncode == 1
    fail = [line for line in doctor.stdout.splitlines() if line.startswith("FAIL: ")]
    assert len(fail) == 1 and all(w in fail[0] for w in words), doctor.stdout


def test_core_works_when_mpi4py_cannot_be_imported(tmp_path):
    """An import hook refuses mpi4py outright (as on a laptop without it)."""
    blocker = (
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'mpi4py' or name.startswith('mpi4py.'):\n"
        "            raise ImportError('No module named mpi4py (blocked by the test)')\n"
        "sys.meta_path.insert(0, _Block())\n"
    )
    done = _run(
        ["-c", blocker + "import raympi; raympi.TrainState; raympi.optim.adam; raympi.comm.form\n" + _USE_CORE],
        None,
        tmp_path,
    )
    assert done.returncode == 0 and "core ok" in done.stdout, done.stderr[-2000:]


def test_forming_with_a_broken_mpi_is_refused(monkeypatch):
    from raympi import comm
    from raympi.comm import library
    from raympi.exceptions import FormationError

    monkeypatch.setattr(library, "library_version", lambda: "MPICH Version:      5.0.0")
    with pytest.raises(FormationError, match="4.3 series"):
        comm.form([object()], timeout_s=5)


def test_doctor_on_the_real_library(tmp_path):
    done = _run(["-m", "raympi", "doctor"], None, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "MPICH Version:      4.3" in done.stdout
    assert "connect  ok" in done.stdout
    for dist in ("ray", "torch", "mpi4py"):
        assert any(line.startswith(dist + " ") for line in done.stdout.splitlines())
    # the gradient transports: the PyPI MPICH is not CUDA-aware; this torch has gloo and NCCL
    assert "mpi      CUDA-aware: no (MPICH built without --with-cuda)" in done.stdout, done.stdout
    assert "gloo     available" in done.stdout
    assert any(line.startswith("nccl     available, NCCL 2.") for line in done.stdout.splitlines()), done.stdout


def test_the_suites_ofi_ranks_publish_the_loopback(tmp_path):
    """Beside test_multihost or test_ray_up, OFI/tcp would publish their namespace hosts' bridge (deleted at their
    teardown, which hung a formation): tests/conftest.py keeps the suite's OFI ranks on the loopback, and an
    ``Open_port`` name says so (its address, hex-coded after the port: ``7F`` is 127.x)."""
    env = {**os.environ, "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
    done = subprocess.run(
        [sys.executable, "-c", "from mpi4py import MPI; print(MPI.Open_port())"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    entry = done.stdout.split("connentry#")[1]  # sockaddr bytes in hex: 766D 0002 00, the port (2 bytes), the address
    assert entry[14:16] == "7F", f"the first byte of the published address is {entry[14:16]}, not 127: {done.stdout}"
