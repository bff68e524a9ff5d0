#!/usr/bin/env bash
# The one command for a lent GPU machine (Python 3.12, torch, mpi4py, numpy and CuPy preinstalled; no
# network, no Ray, no pydantic, no mpich wheel), run from the repo root there:
#
#     bash benchmarks/gpu_run.sh [gpu_check.py options]        # carry: ["benchmarks/out/carry"]
#
# benchmarks/gpu_carry.py made benchmarks/out/carry here.  This script
#   1. makes a venv with --system-site-packages (the machine's torch, mpi4py, numpy and CuPy stay
#      visible) and --without-pip (no ensurepip needed; the machine's pip, run by the venv's python,
#      installs into the venv), and installs ray (slimmed), pydantic and mpich from the carried
#      wheels with --no-index.  A venv rather than --user or --target: its python is sys.executable
#      for Ray's workers too, so they see the same packages with no PYTHONPATH games, and
#      nothing is written into the machine's own site-packages;
#   2. points mpi4py at the carried MPICH (MPI4PY_LIBMPI=<venv>/lib/libmpi.so.12, read by mpi4py 4's
#      MPI-ABI loader in every process, Ray's workers included) and checks which MPI it got, as
#      raympi loads it (raympi.comm.library); when that is not MPICH 4 (an mpi4py built against
#      the machine's own MPI, or mpi4py 3), it installs the carried mpi4py wheel into the venv and
#      checks again;
#   3. installs from the carried fallback/ (--no-deps) only what the machine lacks: matplotlib and
#      its imports (raympi.fit writes a loss plot with it), pillow, torchvision when carried;
#   4. runs PYTHONPATH=$PWD python benchmarks/gpu_check.py "$@", the whole under 8 minutes.
# Environment: PYTHON (default python3), VENV (default ${TMPDIR:-/tmp}/raympi-gpu-venv), CARRY.
set -uo pipefail
began=$SECONDS
total_limit_s=${GPU_RUN_LIMIT_S:-475}
CARRY=${CARRY:-benchmarks/out/carry}
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
VENV=${VENV:-${TMPDIR:-/tmp}/raympi-gpu-venv}
if [[ -n "${OUT:-}" ]]; then
    mkdir -p "$OUT"
    exec > >(tee -a "$OUT/gpu_run.log") 2>&1
fi
say() { printf '[gpu_run %3ds] %s\n' $((SECONDS - began)) "$*"; }

if [[ ! -d "$CARRY/wheels" ]]; then
    say "no $CARRY/wheels: run benchmarks/gpu_carry.py first and carry benchmarks/out/carry"; exit 2
fi
want=$(sed -n 's/.*"python_version": "\([0-9.]*\)".*/\1/p' "$CARRY/carry.json" 2>/dev/null)
have=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
say "python $have ($PYTHON); carry built for ${want:-?}"
[[ -n "$want" && "$want" != "$have" ]] && say "WARNING: the carried wheels are for Python $want, this is $have"

# 1. venv + offline install
t0=$SECONDS
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv --system-site-packages --without-pip "$VENV" || { say "venv failed"; exit 2; }
fi
PY="$VENV/bin/python"
if ! "$PY" -m pip --version >/dev/null 2>&1; then  # the machine has no pip of its own: the venv gets one from ensurepip
    rm -rf "$VENV" && "$PYTHON" -m venv --system-site-packages "$VENV" || { say "venv (with ensurepip) failed"; exit 2; }
fi
pip_install() { "$PY" -m pip install -q --disable-pip-version-check --no-index "$@"; }
pip_install --find-links "$CARRY/wheels" ray pydantic mpich || { say "pip install failed"; exit 2; }
say "installed ray, pydantic, mpich in $((SECONDS - t0)) s (venv $VENV, pip $("$PY" -m pip --version | cut -d' ' -f2))"

# 2. MPI: the carried MPICH, as raympi loads it
LIBMPI=$(ls "$VENV"/lib/libmpi.so.12 2>/dev/null | head -1)
[[ -z "$LIBMPI" ]] && { say "the mpich wheel left no $VENV/lib/libmpi.so.12"; exit 2; }
export MPI4PY_LIBMPI="$LIBMPI"
mpi_check() {
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" - <<'EOF'
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
    say "the machine's mpi4py does not load the carried MPICH 4: installing the carried mpi4py into the venv"
    pip_install --no-deps --ignore-installed --find-links "$CARRY/fallback" mpi4py || say "mpi4py install failed"
    if mpi_check; then say "MPI: the carried mpi4py with the carried MPICH ($MPI4PY_LIBMPI)"
    else say "WARNING: still no MPICH 4 through mpi4py; gpu_check runs anyway (its env stage shows the MPI)"; fi
fi

# 3. what the machine lacks, from fallback/ (--no-deps): matplotlib and what it imports (raympi.fit
#    writes its loss plot with it), pillow, torchvision (when gpu_carry.py had room for them)
need=()
for pair in matplotlib:matplotlib contourpy:contourpy kiwisolver:kiwisolver cycler:cycler pyparsing:pyparsing \
            dateutil:python_dateutil six:six fontTools:fonttools PIL:pillow torchvision:torchvision; do
    mod=${pair%%:*} whl=${pair#*:}
    "$PY" -c "import $mod" >/dev/null 2>&1 && continue
    if ls "$CARRY"/fallback/"$whl"-*.whl >/dev/null 2>&1; then need+=("$whl")
    else say "WARNING: no $mod here and none carried"; fi
done
if (( ${#need[@]} )); then
    pip_install --no-deps --find-links "$CARRY/fallback" "${need[@]}" && say "installed from fallback/: ${need[*]}" \
        || say "WARNING: installing ${need[*]} failed"
fi
"$PY" - <<'EOF'
import importlib
out = []
for name in ("torch", "torchvision", "numpy", "ray", "pydantic", "matplotlib", "PIL", "cupy"):
    try:
        mod = importlib.import_module(name)
        out.append(f"{name} {getattr(mod, '__version__', '?')}")
    except Exception as exc:
        out.append(f"{name} missing ({type(exc).__name__})")
print("versions: " + ", ".join(out))
EOF
say "set up in $((SECONDS - began)) s"

# 4. the check, within what is left of the 8 minutes
left=$((total_limit_s - (SECONDS - began)))
say "running benchmarks/gpu_check.py $* (at most ${left} s)"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout -k 10 "$left" "$PY" benchmarks/gpu_check.py "$@"
rc=$?
if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    say "gpu_check ran past ${left} s (rc $rc); stopping Ray's processes"
    "$VENV/bin/ray" stop --force >/dev/null 2>&1 || true
fi
say "done, rc $rc, in $((SECONDS - began)) s"
exit $rc
