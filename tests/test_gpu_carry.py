"""tools/gpu_carry.py: the slimmed Ray wheel still runs Ray, and the GPU machine's carry fits.

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
from time_limits import limit_s  # a deadline of 2 quiet cores, stretched by the load

ROOT = Path(__file__).resolve().parents[1]


def _gpu_carry():
    spec = importlib.util.spec_from_file_location("gpu_carry", ROOT / "tools" / "gpu_carry.py")
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
    proc = subprocess.run(
        [str(py), "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=limit_s(300)
    )
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


# --------------------------------------------------------------------------- the GPU machine's image, simulated


def _closure(roots: tuple[str, ...], leave_out: tuple[str, ...]) -> list:
    """The installed distributions ``roots`` need, with what those need (extras and markers honoured), less
    ``leave_out`` and what only it brings."""
    import importlib.metadata

    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    def norm(name: str) -> str:
        return name.lower().replace("_", "-").replace(".", "-")

    env = default_environment()
    found: dict[str, importlib.metadata.Distribution] = {}
    done: set[tuple[str, str]] = set()  # (distribution, extra) whose requirements are queued
    todo = [(r, ("",)) for r in roots]
    while todo:
        name, extras = todo.pop()
        if norm(name) in leave_out:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:  # an optional need not installed here
            continue
        key = norm(dist.metadata["Name"])
        found[key] = dist
        for extra in extras:
            if (key, extra) in done:
                continue
            done.add((key, extra))
            for line in dist.requires or []:
                req = Requirement(line)
                wanted = req.marker.evaluate({**env, "extra": extra}) if req.marker else extra == ""
                if wanted:
                    todo.append((req.name, ("", *req.extras)))
    return list(found.values())


def _image_like_venv(where: Path) -> Path:
    """A venv shaped like the GPU machine's ``python3`` (itself a venv's interpreter, holding torch, numpy and
    mpi4py and no Ray, pydantic or mpich): a venv of the base interpreter without ``--system-site-packages``,
    into whose site-packages the top-level files of torch, numpy, mpi4py and pip (with what they need, less the
    mpich wheel) are linked from this interpreter's.  Returns the venv's ``bin/python3``."""
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(where)], check=True)
    site = where / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    for dist in _closure(("torch", "numpy", "mpi4py", "pip"), leave_out=("mpich",)):
        root = Path(dist.locate_file(""))
        for top in {f.parts[0] for f in dist.files or () if f.parts[0] not in ("..", "__pycache__")}:
            if not (site / top).exists() and (root / top).exists():
                (site / top).symlink_to(root / top)
    return where / "bin" / "python3"


def _probe(python: Path, env: dict[str, str]) -> dict:
    """Where ``python`` finds each package (the file it would load, without importing it), and its sys.path."""
    script = textwrap.dedent("""
        import importlib.util, json, sys
        out = {"sys.path": sys.path}
        for name in ("torch", "numpy", "mpi4py", "ray", "pydantic", "raympi"):
            spec = importlib.util.find_spec(name)
            out[name] = spec.origin if spec else None
        print(json.dumps(out))
    """)
    proc = subprocess.run([str(python), "-c", script], env=env, capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpu_run_on_a_simulated_image(tmp_path: Path) -> None:
    """``bash tools/gpu_run.sh --cpu`` end to end in an environment shaped like the GPU machine's: ``python3``
    first on PATH is a venv's interpreter holding torch, numpy and mpi4py only (no Ray, pydantic or mpich, and
    not the base interpreter's pydantic and numpy either), the carry is built here for this Python, pip finds
    nothing but the carry (no index, no pip configuration).  Every stage of gpu_check runs ok, and afterwards
    Ray and pydantic resolve inside that venv, torch and numpy still from the machine's own copies."""
    gc = _gpu_carry()
    carry = tmp_path / "carry"
    gc.build(carry, f"{sys.version_info[0]}.{sys.version_info[1]}", None, fallbacks=True)
    image = tmp_path / "image"
    python3 = _image_like_venv(image)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV", "CONDA")) and k != "RAY_ADDRESS"
    }
    env.update(PATH=f"{python3.parent}:{env['PATH']}", OUT=str(tmp_path / "out"), CARRY=str(carry))
    env["VENV"] = str(tmp_path / "nested-venv")  # where the old gpu_run.sh put its venv
    # The limits are the GPU machine's (16 cores, one device call); 2 loaded cores get room, not a different path.
    env.update(GPU_RUN_LIMIT_S="600", GPU_RUN_SETUP_S="240")
    before = _probe(python3, env)
    site = str(image / "lib")
    assert before["ray"] is None and before["pydantic"] is None and before["raympi"] is None, before
    assert all(before[n] and before[n].startswith(site) for n in ("torch", "numpy", "mpi4py")), before
    assert not any("pyenv" in p and "site-packages" in p for p in before["sys.path"]), before

    proc = subprocess.run(
        ["bash", "tools/gpu_run.sh", "--cpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit_s(780)
    )
    log = proc.stdout + proc.stderr
    report = tmp_path / "out" / "gpu_check_cpu.json"
    assert report.exists(), f"no {report.name} (rc {proc.returncode}):\n{log[-6000:]}"
    stages = json.loads(report.read_text())["stages"]
    assert {k: v["status"] for k, v in stages.items()} == dict.fromkeys(
        ("env", "parity", "nccl1", "shard", "resnet", "sync"), "ok"
    ), log[-6000:]
    assert proc.returncode == 0, log[-6000:]
    assert all(stages[s]["result"]["all_match"] for s in ("parity", "nccl1", "shard")), log[-6000:]

    after = _probe(python3, env)
    assert after["ray"].startswith(site) and after["pydantic"].startswith(site), after
    for name in ("torch", "numpy"):  # the machine's own, not shadowed by anything carried
        assert after[name] == before[name], (name, before[name], after[name])
    ray_dir = Path(after["ray"]).parent
    assert not (ray_dir / "rllib").exists(), "the Ray installed is not the carried (slimmed) wheel"
    assert (tmp_path / "out" / "gpu_run.log").exists()
