#!/usr/bin/env bash
# The one command for a lent GPU machine, run from the repo root there (device call: carry
# ["tools/out/carry"], timeout_s 300; tools/README.md, "GPU check"):
#
#     bash tools/gpu_run.sh [gpu_check.py options]
#
# The machine: python3 is a venv's interpreter (/opt/torch/.venv, Python 3.12) holding torch, numpy, mpi4py and
# CuPy; no Ray, pydantic or mpich wheel; no network; root.  `tools/gpu_carry.py` made tools/out/carry
# here (wheels/: a slimmed Ray, its dependencies, pydantic, mpich; fallback/: mpi4py, matplotlib, ...).  This script
#   1. writes down what it sees (the interpreter, sys.path, where torch, numpy, CuPy and mpi4py load from, every
#      installed distribution) in $OUT/gpu_setup.txt;
#   2. installs ray, pydantic and mpich from the carry into that interpreter's own environment (never a nested
#      venv: one made with --system-site-packages from a venv's interpreter sees the *base* interpreter's
#      packages, not the venv's torch), offline and with pip's configuration ignored (--no-index, --isolated,
#      PIP_CONFIG_FILE=/dev/null), under a constraints file that pins every distribution already installed at its
#      version: pip adds what is missing and changes nothing that is there.  Where that cannot resolve (a carried
#      wheel needs a newer helper), once more with only torch, numpy, CuPy, mpi4py, triton, jax and NVIDIA's
#      libraries pinned.  An environment it cannot write goes to a --prefix on PYTHONPATH instead;
#   3. checks `import torch, ray, mpi4py, raympi` (raympi from this checkout, PYTHONPATH) and that torch, numpy
#      and CuPy still load from where they did, at the same versions;
#   4. points mpi4py at the carried MPICH (MPI4PY_LIBMPI, read by mpi4py 4's loader in every process, Ray's
#      workers included) and checks the MPI raympi gets; when that is not MPICH 4, the carried mpi4py goes to a
#      folder first on PYTHONPATH;
#   5. installs from fallback/ (--no-deps) what the machine lacks of matplotlib and pillow (fit's loss plot);
#   6. runs gpu_check.py "$@" in what is left of GPU_RUN_LIMIT_S (280 s).
# A setup that fails exits 2 at once (within GPU_RUN_SETUP_S, 60 s, if something hangs), having said why; what it
# saw stays in $OUT (gpu_run.log: everything; gpu_setup.txt: the interpreter, pip's output, the versions).
# Environment: PYTHON (default python3), CARRY (default tools/out/carry), OUT (default tools/out/gpu_run).
set -uo pipefail
began=$SECONDS
total_limit_s=${GPU_RUN_LIMIT_S:-280}
setup_limit_s=${GPU_RUN_SETUP_S:-60}
CARRY=${CARRY:-tools/out/carry}
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
LOG_DIR=${OUT:-tools/out/gpu_run}
mkdir -p "$LOG_DIR"
exec > >(tee -a "$LOG_DIR/gpu_run.log") 2>&1
SETUP="$LOG_DIR/gpu_setup.txt"
: >"$SETUP"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/raympi-gpu-run.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
say() { printf '[gpu_run %3ds] %s\n' $((SECONDS - began)) "$*"; }
note() { printf '\n== %s (%d s)\n' "$*" $((SECONDS - began)) >>"$SETUP"; }
fail() {
    say "SETUP FAILED: $*"
    say "what setup saw: $SETUP"
    tail -n 40 "$SETUP" | sed 's/^/    /'
    exit 2
}
# A setup command gets what is left of the setup's limit: a hang cannot eat the device call.
limited() {
    local left=$((setup_limit_s - (SECONDS - began)))
    ((left > 0)) || fail "setup ran past its ${setup_limit_s} s"
    timeout -k 5 "$left" "$@"
}

# pip sees the carry and nothing else: no index, no configuration file, no PIP_* variable.
for v in $(compgen -e | grep '^PIP_'); do unset "$v"; done
export PIP_CONFIG_FILE=/dev/null
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" # raympi, from this checkout
pip_install() {
    note "pip install $*"
    limited "$PY" -m pip --isolated install --no-index --disable-pip-version-check --no-input "${target[@]}" "$@" \
        >>"$SETUP" 2>&1
}

[[ -x "$PYTHON" ]] || fail "no python3 on PATH"
PY=$PYTHON
[[ -d "$CARRY/wheels" ]] || fail "no $CARRY/wheels: run tools/gpu_carry.py here first and carry tools/out/carry"
want=$(sed -n 's/.*"python_version": "\([0-9.]*\)".*/\1/p' "$CARRY/carry.json" 2>/dev/null)
have=$(limited "$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || fail "$PY does not run"
say "python $have ($PY); carry built for ${want:-?}"
[[ -z "$want" || "$want" == "$have" ]] ||
    fail "the carry is for Python $want, this is $have: tools/gpu_carry.py --python-version $have"

# 1. what is there, before anything is installed
note "the interpreter, before"
limited "$PY" - "$WORK" >>"$SETUP" 2>&1 <<'EOF' || fail "could not look at $PY"
import importlib.metadata, importlib.util, json, os, re, sys, sysconfig

work = sys.argv[1]
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
installed = {}
for dist in importlib.metadata.distributions():  # sys.path order: the copy that loads first
    if dist.metadata["Name"]:
        installed.setdefault(norm(dist.metadata["Name"]), dist.version)
protected = re.compile(r"^(torch|numpy|cupy.*|mpi4py|triton|jax|jaxlib|jax-.*|nvidia-.*|cuda-.*)$")
with open(os.path.join(work, "pin-all.txt"), "w") as f:
    f.writelines(f"{n}=={v}\n" for n, v in sorted(installed.items()))
with open(os.path.join(work, "pin-protected.txt"), "w") as f:
    f.writelines(f"{n}=={v}\n" for n, v in sorted(installed.items()) if protected.match(n))
purelib = sysconfig.get_paths()["purelib"]
origins = {}
for name in ("torch", "numpy", "cupy", "mpi4py", "ray", "pydantic"):
    spec = importlib.util.find_spec(name)
    origins[name] = spec.origin if spec else None
facts = {
    "executable": sys.executable,
    "version": sys.version,
    "prefix": sys.prefix,
    "base_prefix": sys.base_prefix,
    "purelib": purelib,
    "purelib_writable": os.access(purelib, os.W_OK),
    "sys.path": sys.path,
    "origins": origins,
    "versions": {n: installed.get(n) for n in ("torch", "numpy", "cupy-cuda13x", "cupy-cuda12x", "mpi4py", "ray")},
}
json.dump(facts, open(os.path.join(work, "before.json"), "w"))
print(json.dumps(facts, indent=1))
print(f"{len(installed)} distributions installed (pinned in the constraints)")
EOF
writable=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["purelib_writable"])' "$WORK/before.json")
target=()
if [[ "$writable" != "True" ]]; then
    prefix="$WORK/prefix"
    site=$("$PY" -c 'import sys, sysconfig; print(sysconfig.get_path("purelib", vars={"base": sys.argv[1], "platbase": sys.argv[1]}))' "$prefix")
    target=(--prefix "$prefix")
    export PYTHONPATH="$PYTHONPATH:$site"
    say "cannot write the interpreter's site-packages: what is missing goes to $prefix (on PYTHONPATH)"
fi

# 2. the carried wheels, offline, into the interpreter's own environment
t0=$SECONDS
if pip_install --find-links "$CARRY/wheels" -c "$WORK/pin-all.txt" ray pydantic mpich; then
    say "installed ray, pydantic, mpich in $((SECONDS - t0)) s, nothing already installed changed"
else
    say "pip failed with every installed distribution pinned (why: $SETUP): again with only torch, numpy," \
        "CuPy, mpi4py and NVIDIA's libraries pinned"
    pip_install --find-links "$CARRY/wheels" -c "$WORK/pin-protected.txt" ray pydantic mpich ||
        fail "pip install from $CARRY/wheels failed (its output is in $SETUP)"
    say "installed ray, pydantic, mpich in $((SECONDS - t0)) s (pip's changes: $SETUP)"
fi

# 3. the imports gpu_check needs, and the machine's torch, numpy and CuPy where they were
check_imports() {
    note "imports, after"
    limited "$PY" - "$WORK/before.json" >>"$SETUP" 2>&1 <<'EOF'
import importlib, importlib.metadata, importlib.util, json, sys

before = json.load(open(sys.argv[1]))
problems = []
for name in ("torch", "ray", "mpi4py", "raympi", "numpy", "pydantic"):
    try:
        mod = importlib.import_module(name)
        print(f"{name} {getattr(mod, '__version__', '?')} from {mod.__file__}")
    except Exception as exc:
        problems.append(f"import {name}: {type(exc).__name__}: {exc}")
for name in ("torch", "numpy", "cupy"):
    was = before["origins"].get(name)
    now = importlib.util.find_spec(name)
    if was and (now is None or now.origin != was):
        problems.append(f"{name} now loads from {now and now.origin}, not {was}")
for name in ("torch", "numpy", "cupy-cuda13x", "cupy-cuda12x"):
    was = before["versions"].get(name)
    if was:
        try:
            now = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            now = None
        if now != was:
            problems.append(f"{name} is {now} now, was {was}")
print("sys.path:", sys.path)
for p in problems:
    print("PROBLEM:", p)
raise SystemExit(1 if problems else 0)
EOF
}
check_imports || fail "$(grep -h '^PROBLEM' "$SETUP" | head -3 | tr '\n' ';')"
say "import torch, ray, mpi4py, raympi: ok; torch, numpy and CuPy load from where they did"

# 4. MPI: the carried MPICH, as raympi loads it
LIBMPI=$(limited "$PY" -c 'import importlib.metadata as m; import os; print(next(os.path.normpath(f.locate()) for f in m.distribution("mpich").files if f.name == "libmpi.so.12"))' 2>>"$SETUP")
[[ -n "$LIBMPI" && -e "$LIBMPI" ]] || fail "the mpich wheel left no libmpi.so.12"
export MPI4PY_LIBMPI="$LIBMPI"
mpi_check() {
    note "MPI"
    limited "$PY" - 2>&1 <<'EOF' | tee -a "$SETUP"
import re, mpi4py
from raympi.comm import library
try:
    line = library.library_version()
except Exception as exc:
    line = f"unavailable: {exc}"
from mpi4py import MPI  # loaded by library_version() when it worked
print(f"mpi4py {mpi4py.__version__} ({mpi4py.__file__}), extension {getattr(MPI, '__file__', '?').rsplit('/', 1)[-1]}")
print(f"MPI library: {line}")
problem = library.problem()
print(f"raympi: {problem or 'usable'}")
ok = bool(re.search(r"MPICH Version:\s*4\.", line)) and problem is None and int(mpi4py.__version__.split('.')[0]) >= 4
raise SystemExit(0 if ok else 1)
EOF
}
if mpi_check; then
    say "MPI: the machine's mpi4py with the carried MPICH ($MPI4PY_LIBMPI)"
else
    say "the machine's mpi4py does not load the carried MPICH 4: the carried mpi4py goes first on PYTHONPATH"
    saved=("${target[@]}")
    target=(--target "$WORK/mpi4py")
    pip_install --no-deps --find-links "$CARRY/fallback" mpi4py || say "WARNING: installing the carried mpi4py failed"
    target=("${saved[@]}")
    export PYTHONPATH="$WORK/mpi4py:$PYTHONPATH"
    if mpi_check; then
        say "MPI: the carried mpi4py with the carried MPICH ($MPI4PY_LIBMPI)"
    else
        fail "no MPICH 4 through mpi4py (see $SETUP)"
    fi
fi

# 5. what the machine lacks of fit's loss plot, from fallback/ (--no-deps)
need=()
for pair in matplotlib:matplotlib contourpy:contourpy kiwisolver:kiwisolver cycler:cycler pyparsing:pyparsing \
    dateutil:python_dateutil six:six fontTools:fonttools PIL:pillow; do
    mod=${pair%%:*} whl=${pair#*:}
    "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$mod') is None)" && continue
    if ls "$CARRY"/fallback/"$whl"-*.whl >/dev/null 2>&1; then
        need+=("$whl")
    else
        say "WARNING: no $mod here and none carried"
    fi
done
if ((${#need[@]})); then
    if pip_install --no-deps --find-links "$CARRY/fallback" "${need[@]}"; then
        say "installed from fallback/: ${need[*]}"
    else
        say "WARNING: installing ${need[*]} failed"
    fi
fi
"$PY" - <<'EOF' 2>&1 | tee -a "$SETUP"
import importlib.metadata as m
out = []
for name in ("torch", "torchvision", "numpy", "ray", "pydantic", "mpi4py", "mpich", "matplotlib", "pillow", "cupy-cuda13x"):
    try:
        out.append(f"{name} {m.version(name)}")
    except m.PackageNotFoundError:
        out.append(f"{name} missing")
print("versions: " + ", ".join(out))
EOF
say "set up in $((SECONDS - began)) s"

# 6. the check, within what is left
left=$((total_limit_s - (SECONDS - began)))
say "running tools/gpu_check.py --budget $((left - 10)) $* (stopped at ${left} s)"
timeout -k 5 "$left" "$PY" tools/gpu_check.py --budget $((left - 10)) "$@"
rc=$?
if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    say "gpu_check ran past ${left} s (rc $rc); stopping Ray's processes"
    "$PY" -m ray.scripts.scripts stop --force >/dev/null 2>&1 || true
fi
say "done, rc $rc, in $((SECONDS - began)) s"
exit $rc
