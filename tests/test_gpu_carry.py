"""benchmarks/gpu_carry.py: the slimmed Ray wheel still runs Ray, and the GPU machine's carry fits.

The two download cases are slow (PyPI through pip's cache: ~80 MB the first time, seconds after);
the synthetic wheel case runs in the default suite.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _gpu_carry():
    spec = importlib.util.spec_from_file_location("gpu_carry", ROOT / "benchmarks" / "gpu_carry.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _record_ok(wheel: Path) -> None:
    """Every file in the wheel has a RECORD line with its hash and size, and RECORD nothing else."""
    with zipfile.ZipFile(wheel) as z:
        names = {n for n in z.namelist() if not n.endswith("/")}  # some wheels hold directory entries too
        record = next(n for n in names if n.count("/") == 1 and n.endswith(".dist-info/RECORD"))
        rows = {r[0]: r for r in csv.reader(io.StringIO(z.read(record).decode())) if r}
        assert set(rows) == names
        for name, (_, digest, size) in rows.items():
            if name == record:
                continue
            data = z.read(name)
            assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert int(size) == len(data)


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def test_slim_wheel_synthetic(tmp_path: Path) -> None:
    files = {
        "ray/__init__.py": b"x = 1\n",
        "ray/jars/big.jar": b"j" * 1000,
        "ray/rllib/a.py": b"a\n",
        "ray/core/src/ray/raylet/raylet": b"#!raylet\n",
        "ray/dashboard/client/build/index.html": b"<html>",
        "ray/dashboard/agent.py": b"agent\n",
        "ray-9.9.9.dist-info/entry_points.txt": b"[console_scripts]\nray = ray.scripts.scripts:main\n"
        b"rllib = ray.rllib.scripts:cli\nserve = ray.serve.scripts:cli\n",
    }
    wheel = tmp_path / "ray-9.9.9-cp311-cp311-manylinux2014_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o755 if name.endswith("raylet") else 0o644) << 16
            z.writestr(info, data)
        record = "".join(f"{n},{_hash(d)},{len(d)}\n" for n, d in files.items()) + "ray-9.9.9.dist-info/RECORD,,\n"
        z.writestr("ray-9.9.9.dist-info/RECORD", record)
    before, after = _gpu_carry().slim_wheel(wheel, strip=False)
    assert after < before
    _record_ok(wheel)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert not any(n.startswith(("ray/jars/", "ray/rllib/", "ray/dashboard/client/")) for n in names)
        assert {"ray/__init__.py", "ray/core/src/ray/raylet/raylet", "ray/dashboard/agent.py"} <= names
        assert z.getinfo("ray/core/src/ray/raylet/raylet").external_attr >> 16 == 0o755
        assert z.read("ray-9.9.9.dist-info/entry_points.txt").decode().split() == [
            "[console_scripts]",
            "ray",
            "=",
            "ray.scripts.scripts:main",
        ]
    assert _gpu_carry().slim_wheel(wheel, strip=False) == (after, after)  # a slim wheel stays as it is


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_slim_ray_runs_an_actor(tmp_path: Path) -> None:
    """A cp311 carry of the installed Ray (slimmed and stripped as for the GPU machine), installed offline
    into a fresh venv of the base interpreter: Ray starts, runs an actor with a runtime_env, stops."""
    gc = _gpu_carry()
    summary = gc.build(tmp_path / "carry", f"{sys.version_info[0]}.{sys.version_info[1]}", None, fallbacks=False)
    (ray_wheel,) = (tmp_path / "carry" / "wheels").glob("ray-*.whl")
    assert summary["ray_wheel"]["after"] < 0.55 * summary["ray_wheel"]["before"]
    _record_ok(ray_wheel)
    venv = tmp_path / "venv"
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-index",
            "--find-links",
            str(tmp_path / "carry" / "wheels"),
            "ray",
            "pydantic",
        ],
        check=True,
    )
    script = textwrap.dedent("""
        import importlib.util, json, os, ray
        ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR",
                 runtime_env={"env_vars": {"SLIM_CHECK": "yes"}})
        @ray.remote
        class Probe:
            def where(self):
                return os.environ.get("SLIM_CHECK"), ray.__file__
        out = ray.get(Probe.remote().where.remote(), timeout=120)
        ray.shutdown()
        print(json.dumps({"actor": out, "rllib": importlib.util.find_spec("ray.rllib") is not None,
                          "jars": os.path.isdir(os.path.join(os.path.dirname(ray.__file__), "jars"))}))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PYTHON"))}
    proc = subprocess.run([str(py), "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["actor"][0] == "yes" and result["actor"][1].startswith(str(venv))
    assert not result["rllib"] and not result["jars"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpu_machine_carry_fits(tmp_path: Path) -> None:
    """The cp312 carry for the GPU machine (ray, its core deps, pydantic, mpich, and what fits of the
    fallbacks) stays within 64 MiB minus the working tree minus the margin."""
    gc = _gpu_carry()
    dest = tmp_path / "carry"
    assert gc.main(["--dest", str(dest)]) == 0
    summary = json.loads((dest / gc.SUMMARY_NAME).read_text())
    assert gc.dir_bytes(dest) <= gc.carry_limit(gc.tree_bytes())
    names = " ".join(summary["wheels"])
    for project in ("ray-", "pydantic-", "pydantic_core-", "mpich-4.", "msgpack-", "protobuf-", "jsonschema-"):
        assert project in names, project
    assert "cp312" in summary["ray_wheel"]["name"]
    assert {"mpi4py", "matplotlib"} <= set(summary["fallback_groups"])  # the first two fallbacks always fit
