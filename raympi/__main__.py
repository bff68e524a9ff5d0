"""Command line: ``python -m raympi doctor`` (or ``raympi doctor``) checks this machine; ``python -m raympi report
RUN_DIR`` summarizes a run's folder (each rank's time, the restarts, the hangs) and draws its timeline."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys

_PAIR = r"""
import sys
from raympi.comm import library
MPI = library.init()
if sys.argv[1] == "accept":
    port = MPI.Open_port()
    print(port, flush=True)
    inter = MPI.COMM_SELF.Accept(port)
    MPI.Close_port(port)
else:
    inter = MPI.COMM_SELF.Connect(sys.stdin.readline().strip())
comm = inter.Merge(high=sys.argv[1] == "connect")
total = comm.allreduce(comm.Get_rank() + 1)
assert comm.Get_size() == 2 and total == 3, (comm.Get_size(), total)
print("ok", flush=True)
"""

_RAY = r"""
import ray
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
res = ray.cluster_resources()
print(
    f"{len([n for n in ray.nodes() if n['Alive']])} node(s): "
    + ", ".join(f"{k}={v:g}" for k, v in sorted(res.items()) if "node:" not in k)
)
"""


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def check_connect_accept(timeout_s: float = 30.0) -> str | None:
    """Join two fresh singleton processes over Open_port/Accept/Connect; None on success, else why not."""
    cmd = [sys.executable, "-c", _PAIR]
    server = subprocess.Popen(cmd + ["accept"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    client = None
    try:
        port = server.stdout.readline()
        if not port.strip():
            return "the accepting process printed no port: " + server.stderr.read().strip()[-300:]
        client = subprocess.Popen(
            cmd + ["connect"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        out, err = client.communicate(port, timeout=timeout_s)
        server.wait(timeout=timeout_s)
        if client.returncode or "ok" not in out:
            return "connect failed: " + err.strip()[-300:]
        return None
    except subprocess.TimeoutExpired:
        return f"connect/accept did not finish within {timeout_s:g} s"
    finally:
        for p in (server, client):
            if p is not None and p.poll() is None:
                p.kill()


def ray_cluster(timeout_s: float = 30.0) -> str:
    """A line describing the reachable Ray cluster, or why there is none."""
    if not os.environ.get("RAY_ADDRESS") and not os.path.exists("/tmp/ray/ray_current_cluster"):
        return "none running (raympi.fit starts a local one)"
    try:
        done = subprocess.run([sys.executable, "-c", _RAY], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"recorded as running but not reachable within {timeout_s:g} s (stale? `ray stop`)"
    if done.returncode:
        return "not reachable: " + (done.stderr.strip().splitlines() or ["?"])[-1]
    return done.stdout.strip()


def transports() -> dict[str, str]:
    """One line per gradient transport (``fit(grad_transport=...)``): what this machine offers."""
    from raympi.comm import library

    import torch
    from torch import distributed as dist

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = "not in this torch build"
    if dist.is_available() and dist.is_nccl_available():
        version = ".".join(str(v) for v in torch.cuda.nccl.version())
        nccl = f"available, NCCL {version}" + (f", {gpus} GPU(s) visible" if gpus else " (no GPU visible here)")
    gloo = "available" if dist.is_available() and dist.is_gloo_available() else "not in this torch build"
    return {"mpi": f"CUDA-aware: {library.cuda_aware()}", "gloo": gloo, "nccl": nccl}


def doctor() -> int:
    """Print versions and checks; 0 when MPI works, 1 with a one-line reason otherwise."""
    from raympi.comm import library

    for dist in ("raympi", "ray", "torch", "mpi4py", "mpich"):
        print(f"{dist:8} {_version(dist)}")
    reason = library.problem()
    print(f"{'MPI':8} {'-' if reason else library.library_version()}")
    if reason:
        print(f"FAIL: {reason}")
        return 1
    failure = check_connect_accept()
    print(f"{'connect':8} {'ok: two singleton processes joined one communicator' if failure is None else 'FAILED'}")
    for name, line in transports().items():
        print(f"{name:8} {line}")
    print(f"{'ray':8} {ray_cluster()}")
    if failure:
        print(f"FAIL: {failure}")
        return 1
    return 0


def report(run_dir: str) -> int:
    """Print the summary of the run in ``run_dir`` and write its ``timeline.png`` there; 1 with a one-line reason
    when there is no run."""
    import fsspec

    from raympi.driver import summary, timeline

    fs, folder = fsspec.core.url_to_fs(run_dir)
    if "://" not in run_dir:  # a local path: shown as given
        folder = run_dir.rstrip("/") or "/"
    try:
        run = summary.read_run(folder, fs)
    except FileNotFoundError as exc:
        print(f"raympi report: {exc}", file=sys.stderr)
        return 1
    path = f"{folder.rstrip('/')}/timeline.png"
    try:  # drawn first: the summary's reader may stop early (``| head``)
        timeline.write_timeline(run.lines, run.restarts, path, fs)
        drawn = f"timeline: {path}"
    except OSError as exc:  # a folder we may read but not write
        drawn = f"timeline: not written to {path} ({exc.strerror or exc})"
    print(summary.format_summary(run))
    print(drawn)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raympi", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="check the MPI library, connect/accept and the Ray cluster")
    summarize = sub.add_parser(
        "report", help="summarize a run's folder: each rank's time, the restarts, the hangs; writes timeline.png"
    )
    summarize.add_argument("run_dir", metavar="RUN_DIR", help="the run's folder (fit's checkpoint_dir)")
    args = parser.parse_args(argv)
    try:
        if args.command == "doctor":
            return doctor()
        return report(args.run_dir)
    except BrokenPipeError:  # the output went to a reader that stopped early (``| head``): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (Python's flush at exit would fail again)
        return 0


if __name__ == "__main__":
    sys.exit(main())
