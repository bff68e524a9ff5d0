"""The wheels a lent GPU machine needs for ``tools/gpu_check.py``, small enough to travel with the repo.

The GPU machine (1 x H200, Python 3.12, torch, mpi4py, CuPy and numpy preinstalled) has no network,
no Ray, no pydantic and no ``mpich`` wheel, and at most 64 MiB travel per call: the repo's working
tree plus the "carry" paths.  Ray's wheel alone is ~79 MB, so this script

  1. ``pip download``s (binary only, for ``--python-version``, manylinux x86_64) into
     ``tools/out/carry/wheels/``: ``ray==<the version installed here>`` without its
     dependencies, then Ray's core runtime dependencies (its METADATA's ``Requires-Dist`` lines
     without an extra) with theirs, pydantic 2 with its own, and ``mpich>=4.3,<5`` (MPICH 5 breaks
     connect/accept between singletons, see the README), every version pinned to the one installed
     here where there is one (the combination the tests run);
  2. downloads into ``tools/out/carry/fallback/`` what ``gpu_run.sh`` installs only when the
     machine's own copy does not work: ``mpi4py`` (when the preinstalled one cannot load the
     carried MPICH) and ``torchvision`` for ``--torch`` (the ResNet-18 stage; ``--no-deps``);
  3. slims the Ray wheel in place (:func:`slim_wheel`): drops what raympi never loads (the Java
     jars, RLlib, Serve, Tune, Train, Data, LLM, Workflow, the dashboard's web front end) with
     their RECORD lines and console scripts, and re-zips it under the same name; the raylet, the
     GCS server, ``_raylet.so``, the runtime-env agent and its vendored aiohttp stay;
  4. prints each wheel's size (Ray's before and after slimming) and the total, and exits 1 when
     the carry exceeds 64 MiB minus the repo's working tree minus a 2 MiB margin.

    .venv/bin/python tools/gpu_carry.py                    # cp312 carry for the GPU machine
    .venv/bin/python tools/gpu_carry.py --python-version 3.11 --dest /tmp/carry311   # one to try here

Then on the GPU machine: ``bash tools/gpu_run.sh`` with carry ``["tools/out/carry"]``.
pip keeps its downloads in its HTTP cache, so a second run costs seconds.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib.metadata
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DEST = ROOT / "tools" / "out" / "carry"
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
MiB = 1 << 20
TRAVEL_LIMIT = 64 * MiB  # what one call of the device tool carries: working tree + carry paths
MARGIN = 2 * MiB

# What raympi never loads: ray/<name>/ is removed from the wheel.  Sizes in Ray 2.60's cp312 wheel,
# compressed: jars 32.2 MB, rllib 1.7, data 1.4, serve 0.6, tune 0.4, train 0.4, llm 0.3, the
# dashboard's web front end (dashboard/client/build, served only by the dashboard head) 2.5.
SLIM_REMOVE = (
    "ray/jars/",
    "ray/rllib/",
    "ray/serve/",
    "ray/llm/",
    "ray/tune/",
    "ray/train/",
    "ray/data/",
    "ray/workflow/",
    "ray/dashboard/client/build/",
)
# matplotlib (fit() writes its loss plot with it, Agg, PNG): its tests, sample data and every font
# but DejaVu Sans (regular and bold, the default) and LastResortHE (its fallback) (9.4 -> 4.7 MB);
# pillow: the AVIF plugin and its library (2.3 MB).
SLIM_RULES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {  # wheel name -> (remove, but keep)
    "ray": (SLIM_REMOVE, ()),
    "matplotlib": (
        ("matplotlib/tests/", "matplotlib/mpl-data/sample_data/", "matplotlib/mpl-data/fonts/"),
        (
            "matplotlib/mpl-data/fonts/ttf/DejaVuSans.ttf",
            "matplotlib/mpl-data/fonts/ttf/DejaVuSans-Bold.ttf",
            "matplotlib/mpl-data/fonts/ttf/LastResortHE-Regular.ttf",
        ),
    ),
    "pillow": (("PIL/_avif.", "pillow.libs/libavif-"), ()),
    # matplotlib imports fontTools (dviread); its compiled modules are optional speed-ups of the .py
    # files shipped beside them (5.4 -> 2.1 MB).  "*x": a name ending in x.
    "fonttools": (("*.so",), ()),
}
# The console scripts of the removed packages (entry_points.txt lines whose target is under one).
_REMOVED_MODULES = tuple(p[:-1].replace("/", ".") for p in SLIM_REMOVE)

STRIP_MIN_BYTES = 4 * MiB

SUMMARY_NAME = "carry.json"


# --------------------------------------------------------------------------- slimming


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _dist_info(name: str, file: str) -> bool:
    """``name`` is the wheel's own ``<project>-<version>.dist-info/<file>`` (not one vendored deeper down)."""
    parts = name.split("/")
    return len(parts) == 2 and parts[0].endswith(".dist-info") and parts[1] == file


def _rule(wheel: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return SLIM_RULES[_norm(wheel.name.split("-", 1)[0])]


def _slim_entry_points(text: str) -> str:
    keep = []
    for line in text.splitlines():
        target = line.split("=", 1)[1].strip() if "=" in line and not line.lstrip().startswith("[") else ""
        if target.startswith(_REMOVED_MODULES):
            continue
        keep.append(line)
    return "\n".join(keep) + "\n"


def _strip(data: bytes) -> bytes:
    """``strip --strip-unneeded`` of an ELF file's bytes (its .symtab; .dynsym stays, so it still links)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in", Path(tmp) / "out"
        src.write_bytes(data)
        subprocess.run(["strip", "--strip-unneeded", "-o", str(dst), str(src)], check=True, capture_output=True)
        return dst.read_bytes()


def slim_wheel(
    path: Path, out: Path | None = None, compresslevel: int = 9, strip: bool | None = None
) -> tuple[int, int]:
    """Rewrite the wheel ``path`` (in place, or to ``out``) without what :data:`SLIM_RULES` removes
    for its project (Ray: :data:`SLIM_REMOVE`).

    ``strip`` (default: when the ``strip`` tool is on PATH) also strips the symbol tables of the
    ELF files over :data:`STRIP_MIN_BYTES` (``_raylet.so``, ``gcs_server``, ``raylet``: ~4.5 MB of
    the wheel; their C++ backtraces then name fewer functions).  Other files kept are
    byte-identical (their RECORD hashes still hold); a changed file (a stripped binary,
    ``entry_points.txt`` without the console scripts of removed packages) gets a fresh RECORD
    line; RECORD loses the removed files' lines.  Returns (bytes before, bytes after).  Slimming
    an already slim wheel in place is a no-op.
    """
    if strip is None:
        strip = shutil.which("strip") is not None
    path = Path(path)
    out = Path(out) if out else path
    remove, keep = _rule(path)

    prefixes = tuple(r for r in remove if not r.startswith("*"))
    suffixes = tuple(r[1:] for r in remove if r.startswith("*"))

    def _removed(name: str) -> bool:
        return (name.startswith(prefixes) or (bool(suffixes) and name.endswith(suffixes))) and not name.startswith(keep)

    before = path.stat().st_size
    tmp = out.with_name(out.name + ".partial")
    with zipfile.ZipFile(path) as src:
        infos = src.infolist()
        record_name = next(i.filename for i in infos if _dist_info(i.filename, "RECORD"))
        if not any(_removed(i.filename) for i in infos) and out == path:
            return before, before
        replaced: dict[str, bytes] = {}
        for info in infos:
            if _dist_info(info.filename, "entry_points.txt"):
                replaced[info.filename] = _slim_entry_points(src.read(info).decode()).encode()
            elif strip and info.file_size >= STRIP_MIN_BYTES and not _removed(info.filename):
                data = src.read(info)
                if data[:4] == b"\x7fELF":
                    replaced[info.filename] = _strip(data)
        rows = []
        for row in csv.reader(io.StringIO(src.read(record_name).decode())):
            if not row or _removed(row[0]):
                continue
            if row[0] in replaced:
                row = [row[0], _record_hash(replaced[row[0]]), str(len(replaced[row[0]]))]
            rows.append(row)
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(rows)
        replaced[record_name] = buf.getvalue().encode()
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=compresslevel) as dst:
            for info in infos:
                if _removed(info.filename):
                    continue
                data = replaced.get(info.filename)
                if data is None:
                    data = src.read(info)
                zi = zipfile.ZipInfo(info.filename, info.date_time)
                zi.external_attr = info.external_attr  # keeps the executable bits of raylet / gcs_server
                zi.compress_type = zipfile.ZIP_DEFLATED
                dst.writestr(zi, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=compresslevel)
    os.replace(tmp, out)
    return before, out.stat().st_size


# --------------------------------------------------------------------------- downloading


def _pip_download(
    dest: Path, python_version: str, specs: list[str], *, no_deps: bool = False, constraints: Path | None = None
) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        "-d",
        str(dest),
    ]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    if no_deps:
        cmd.append("--no-deps")
    if constraints:
        cmd += ["-c", str(constraints)]
    cmd += specs
    print("$ pip download " + " ".join(specs) + (" --no-deps" if no_deps else ""), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"pip download failed ({proc.returncode}): {' '.join(specs)}")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_versions() -> dict[str, str]:
    """{normalized name: version} of the distributions installed with this interpreter."""
    out = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name and "+" not in dist.version:  # local versions (torch 2.x+cpu) are no PyPI pins
            out.setdefault(_norm(name), dist.version)
    return out


def core_requirements(wheel: Path, python_version: str) -> list[str]:
    """The ``Requires-Dist`` lines of ``wheel`` without an extra whose marker holds on the target."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if _dist_info(n, "METADATA"))
        text = z.read(meta).decode()
    env = {
        **default_environment(),
        "python_version": python_version,
        "python_full_version": python_version + ".0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "extra": "",
    }
    reqs = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and ("extra" in str(req.marker) or not req.marker.evaluate(env)):
            continue
        reqs.append(f"{req.name}{req.specifier}")
    return reqs


def torchvision_spec(torch_version: str) -> str:
    """torchvision's series for a torch 2.x (2.11 -> 0.26.*)."""
    major, minor = (int(p) for p in torch_version.split(".")[:2])
    if major != 2:
        raise SystemExit(f"--torch {torch_version}: only torch 2.x is mapped to a torchvision series")
    return f"torchvision==0.{minor + 15}.*"


# What gpu_run.sh installs only when the machine lacks it (or, for mpi4py, when the machine's cannot load
# the carried MPICH), in priority order: a group that would push the carry over its limit is left out,
# from the last one back.  All --no-deps, each a wheel in fallback/.
FALLBACKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mpi4py", ("mpi4py>=4",)),
    # raympi.fit writes its loss plot (raympi/driver/report.py): matplotlib with what it imports at
    # ``import matplotlib.pyplot`` + Agg PNG (fontTools too: matplotlib.dviread imports it).
    (
        "matplotlib",
        ("matplotlib>=3.7", "contourpy", "kiwisolver", "cycler", "pyparsing", "python-dateutil", "six", "fonttools"),
    ),
    ("pillow", ("pillow",)),  # matplotlib's images, torchvision's transforms
    ("torchvision", ()),  # the series of --torch (the ResNet-18 stage)
)


def build(
    dest: Path, python_version: str, torch_version: str | None, fallbacks: bool = True, limit: int | None = None
) -> dict:
    """Download and slim into ``dest``; returns the summary written to ``dest/carry.json``.

    ``limit``: bytes the carry may take; fallback groups that do not fit are dropped, last first.
    """
    ray_version = importlib.metadata.version("ray")
    wheels, fallback = dest / "wheels", dest / "fallback"
    for d in (wheels, fallback):
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
    pins = installed_versions()
    constraints = dest / "constraints.txt"
    constraints.write_text(
        "".join(f"{n}=={v}\n" for n, v in sorted(pins.items()) if n not in ("raympi", "ray", "torch", "torchvision"))
    )
    t0 = time.monotonic()
    _pip_download(wheels, python_version, [f"ray=={ray_version}"], no_deps=True)
    (ray_wheel,) = wheels.glob("ray-*.whl")
    reqs = core_requirements(ray_wheel, python_version)
    _pip_download(wheels, python_version, reqs + ["pydantic>=2,<3", "mpich>=4.3,<5"], constraints=constraints)
    groups: dict[str, list[Path]] = {}
    if fallbacks:
        for group, specs in FALLBACKS:
            if group == "torchvision":
                if not torch_version:
                    continue
                specs = (torchvision_spec(torch_version),)
            tmp = dest / f".fallback-{group}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            _pip_download(
                tmp,
                python_version,
                list(specs),
                no_deps=True,
                constraints=None if group == "torchvision" else constraints,
            )
            groups[group] = []
            for whl in tmp.glob("*.whl"):
                os.replace(whl, fallback / whl.name)
                groups[group].append(fallback / whl.name)
            tmp.rmdir()
    constraints.unlink()
    download_s = time.monotonic() - t0
    t0 = time.monotonic()
    slimmed = {}
    for whl in [ray_wheel, *fallback.glob("*.whl")]:
        if _norm(whl.name.split("-", 1)[0]) in SLIM_RULES:
            slimmed[whl.name] = slim_wheel(whl)
    slim_s = time.monotonic() - t0
    dropped = []
    if limit is not None:
        for group in reversed(list(groups)):
            if dir_bytes(dest) <= limit:
                break
            for whl in groups.pop(group):
                whl.unlink()
            dropped.append(group)
    summary = {
        "python_version": python_version,
        "ray": ray_version,
        "ray_core_requirements": reqs,
        "ray_wheel": {
            "name": ray_wheel.name,
            "before": slimmed[ray_wheel.name][0],
            "after": slimmed[ray_wheel.name][1],
            "removed": list(SLIM_REMOVE),
        },
        "slimmed": {name: {"before": b, "after": a} for name, (b, a) in slimmed.items()},
        "wheels": {p.name: p.stat().st_size for p in sorted(wheels.glob("*.whl"))},
        "fallback": {p.name: p.stat().st_size for p in sorted(fallback.glob("*.whl"))},
        "fallback_groups": {g: sorted(p.name for p in ps) for g, ps in groups.items()},
        "fallback_dropped_for_size": dropped,
        "download_s": round(download_s, 1),
        "slim_s": round(slim_s, 1),
    }
    (dest / SUMMARY_NAME).write_text(json.dumps(summary, indent=1))
    return summary


# --------------------------------------------------------------------------- sizes


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of the working tree that travels: tracked files plus untracked ones git does not ignore."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    total = 0
    for name in {n for n in names if n}:
        p = root / os.fsdecode(name)
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def carry_limit(tree: int) -> int:
    return TRAVEL_LIMIT - tree - MARGIN


def _mib(n: int) -> str:
    return f"{n / MiB:7.2f}"


def report(dest: Path, summary: dict) -> tuple[int, int]:
    """Print the size table; returns (carry bytes, limit)."""
    slimmed = summary["slimmed"]
    print(f"\n{'wheel':<72} {'MiB':>7} {'before slimming':>16}")
    for where in ("wheels", "fallback"):
        for name, size in summary[where].items():
            before = f"{_mib(slimmed[name]['before'])}" if name in slimmed else ""
            print(f"{where + '/' + name:<72} {_mib(size)} {before:>16}")
    if summary["fallback_dropped_for_size"]:
        print(f"fallbacks left out (over the limit): {', '.join(summary['fallback_dropped_for_size'])}")
    total, tree = dir_bytes(dest), tree_bytes()
    limit = carry_limit(tree)
    rows = (
        ("wheels/ total", sum(summary["wheels"].values())),
        ("fallback/ total", sum(summary["fallback"].values())),
        (f"carry total ({dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})", total),
        ("working tree (tracked + untracked, not ignored)", tree),
        ("limit: 64 MiB - tree - 2 MiB margin", limit),
        ("travels in all (tree + carry)", total + tree),
    )
    for label, size in rows:
        print(f"{label:<72} {_mib(size)}")
    return total, limit


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    ap.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    ap.add_argument(
        "--torch", default="2.11", help="the GPU machine's torch, for the fallback torchvision ('' for none)"
    )
    ap.add_argument("--no-fallbacks", action="store_true", help="no fallback/ wheels (see FALLBACKS)")
    args = ap.parse_args(argv)
    dest = args.dest.resolve()
    dest.mkdir(parents=True, exist_ok=True)
    summary = build(
        dest, args.python_version, args.torch or None, fallbacks=not args.no_fallbacks, limit=carry_limit(tree_bytes())
    )
    print(f"downloaded in {summary['download_s']} s, slimmed in {summary['slim_s']} s")
    total, limit = report(dest, summary)
    if total > limit:
        print(f"FAIL: the carry is {total / MiB:.2f} MiB, over its {limit / MiB:.2f} MiB limit")
        return 1
    print(f"ok: {(limit - total) / MiB:.2f} MiB to spare")
    return 0


if __name__ == "__main__":
    sys.exit(main())
