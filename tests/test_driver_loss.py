"""Driver loss: ``kill -9`` of the driver mid-run, then the same ``fit(..., resume=True)``.

The driver owns the data order and the checkpoints, so its death ends the run; what must hold is
that nothing of it lingers (its workers and, on a local run, the Ray instance it started) and that
the same call with ``resume=True`` continues from the newest intact checkpoint at its exact data
cursor and ends on the uninterrupted run's parameters.
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
import time_limits
import torch

import raympi

# 1024 samples / batch 32 = 32 steps an epoch, 2 epochs: the kill lands in the first, the resume crosses into the second
TOTAL = 64

DRIVER = """
import json, sys, time, torch, raympi
from torch import nn

class Slow(nn.Sequential):  # >= 20 ms a step, so the kill lands mid-run on any machine
    def forward(self, x):
        time.sleep(0.02)
        return super().forward(x)

class FirstStep:
    first = None
    def on_step(self, record):
        if self.first is None:
            self.first = record["step"]

folder, params_out, resume, address = sys.argv[1], sys.argv[2], sys.argv[3] == "resume", sys.argv[4]
torch.manual_seed(0)
model = Slow(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 2))
g = torch.Generator().manual_seed(0)
x = torch.randn(1024, 20, generator=g); y = (x[:, 0] + x[:, 1] > 0).long()
seen = FirstStep()
result = raympi.fit(model, (x, y), workers=2, epochs=2, batch_size=32, seed=1, checkpoint_dir=folder,
                    checkpoint_every=10, optimizer=raympi.optim.sgd(0.05, momentum=0.9), progress=False,
                    address=address, resume=resume, callbacks=[seen])
torch.save(result.state.params, params_out)
print(json.dumps({"first_step": seen.first, "steps": [r["step"] for r in result.metrics],
                  "restarts": [{k: r.get(k) for k in ("kind", "path", "cause")} for r in result.restarts]}), flush=True)
"""


def _env() -> dict[str, str]:
    return {**os.environ, "RAY_ADDRESS": "", "OMP_NUM_THREADS": "1"}


def _driver(
    folder: pathlib.Path,
    params: pathlib.Path,
    mode: str,
    address: str,
    log: pathlib.Path,
    extra_env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """A driver process in a session of its own (its sid is its pid: everything it starts is found by that)."""
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(folder), str(params), mode, address],
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
        env={**_env(), **(extra_env or {})},
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen, log: pathlib.Path, timeout: float = 300) -> dict:
    out, _ = proc.communicate(timeout=time_limits.limit_s(timeout))  # on 2 quiet cores, stretched by the load
    assert proc.returncode == 0, log.read_text()[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _in_session(sid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes of session ``sid``."""
    found = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (ProcessLookupError, PermissionError):
            pass
    return found


def _describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {_title(p)[:100]}")
        except psutil.Error:
            pass
    return out


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    live = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                live.append(p)
        except psutil.Error:
            pass
    return live


# Ray's agents see the raylet die within ~2 s, then spend Ray's fixed 60 s timeout publishing "raylet died"
# to the dead GCS before they exit (ray/_private/process_watcher.py): they linger ~62 s, idle, and go by themselves.
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def _title(p: psutil.Process) -> str:
    """What ``ps`` shows: Ray retitles its workers ('ray::Worker.run'), other processes show their command line."""
    return " ".join(p.cmdline()) or p.name()


def _is_agent(p: psutil.Process) -> bool:
    try:
        return _title(p).startswith(RAY_AGENTS)
    except psutil.Error:
        return False


def _kill(procs: list[psutil.Process]) -> None:
    for p in procs:  # by pid, ours only
        try:
            p.kill()
        except psutil.Error:
            pass


def _ray_workers(sid: int) -> list[psutil.Process]:
    """raympi's actors (Ray titles them 'ray::Worker...') among the processes of session ``sid``."""
    found = []
    for p in _in_session(sid):
        try:
            if _title(p).startswith("ray::Worker"):
                found.append(p)
        except psutil.Error:
            pass
    return found


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now (each held until all are found): a fixed one may be another Ray's, the other
    test process's or a user's."""
    held = [socket.socket() for _ in range(n)]
    try:
        for s in held:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def _kill_driver_at(
    proc: subprocess.Popen, folder: pathlib.Path, log: pathlib.Path, step: int = 20, cluster_sid: int | None = None
) -> tuple[dict[psutil.Process, str], list[psutil.Process]]:
    """SIGKILL the driver alone (not its group: a crash, not a Ctrl-C) once the checkpoint of ``step`` exists.

    Returns what was alive just before: the driver's descendants with their titles, and raympi's actors
    in the session ``cluster_sid`` (an external cluster's, where they are not the driver's descendants).
    """
    deadline = time.monotonic() + 120
    while not (folder / f"step-{step:08d}").exists():
        assert proc.poll() is None, f"the driver ended before step {step}: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no checkpoint of step {step} within 120 s"
        time.sleep(0.02)
    descendants = {}
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            descendants[p] = _title(p)
        except psutil.Error:
            pass
    actors = _ray_workers(cluster_sid) if cluster_sid is not None else []
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    return descendants, actors


@pytest.fixture
def reaper():
    """Session ids whose processes (ours: started by this test) are killed, by pid, at teardown."""
    sids: list[int] = []
    yield sids
    for sid in sids:
        _kill(_in_session(sid))


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_killed_driver_leaves_nothing_and_resume_ends_on_the_uninterrupted_run(tmp_path, reaper):
    # The uninterrupted run and the run to be killed go side by side: their startups and sleeps overlap.
    base_log, killed_log = tmp_path / "base.log", tmp_path / "killed.log"
    base = _driver(tmp_path / "base", tmp_path / "base.pt", "fresh", "local", base_log)
    folder = tmp_path / "ck"
    victim = _driver(folder, tmp_path / "unused.pt", "fresh", "local", killed_log)
    reaper += [base.pid, victim.pid]
    descendants, _ = _kill_driver_at(victim, folder, killed_log)
    killed_at = time.monotonic()
    started = " | ".join(descendants.values())
    assert "gcs_server" in started and "raylet" in started and "ray::Worker" in started, started  # Ray was the driver's

    # Everything the driver started goes with it within a bounded time: its Ray instance (gcs_server, raylet,
    # dashboard, monitors: Ray gives them PR_SET_PDEATHSIG) and raympi's ray::Worker actors with whatever they
    # started (they exit when their raylet goes). Ray's two agents are the exception (see RAY_AGENTS).
    watched = [p for p in descendants if not descendants[p].startswith(RAY_AGENTS)]
    watched += [p for p in _in_session(victim.pid) if p not in descendants and not _is_agent(p)]
    gone: dict[int, float] = {}
    while time.monotonic() - killed_at < 30:
        for p in watched:
            if p not in _alive([p]) and p.pid not in gone:
                gone[p.pid] = time.monotonic() - killed_at
        if len(gone) == len(watched):
            break
        time.sleep(0.05)
    left = _alive(watched)
    _kill(left)
    assert not left, f"still alive 30 s after the driver's SIGKILL: {_describe(left)}"
    worker_times = [gone[p.pid] for p in watched if descendants.get(p, "").startswith("ray::Worker")]
    print(
        f"\nlocal run: {len(watched)} processes of the killed driver gone within {max(gone.values()):.1f} s "
        f"(its ray::Worker actors after {min(worker_times):.1f}-{max(worker_times):.1f} s)"
    )

    # The newest intact checkpoint (the driver may have died writing a later one: that one is still a .tmp).
    newest = max(int(p.name[5:]) for p in folder.glob("step-*"))
    assert raympi.load_checkpoint(str(folder)).step.item() == newest >= 20

    resumed_log = tmp_path / "resumed.log"
    again = _driver(folder, tmp_path / "resumed.pt", "resume", "local", resumed_log)
    reaper.append(again.pid)
    resumed = _finish(again, resumed_log)
    print(f"resumed from step {newest}")
    uninterrupted = _finish(base, base_log)
    assert uninterrupted["steps"] == list(range(1, TOTAL + 1)) and uninterrupted["first_step"] == 1
    assert resumed["first_step"] == newest + 1, (resumed, newest)
    assert resumed["steps"] == list(range(1, TOTAL + 1)), resumed
    print(f"restarts: uninterrupted {uninterrupted['restarts']}, resumed {resumed['restarts']}")
    diff = _max_diff(torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "base.pt"))
    assert diff < 1e-4, diff


@pytest.mark.skipif(shutil.which("ray", path=os.path.dirname(sys.executable)) is None, reason="needs the ray CLI")
def test_on_an_external_cluster_ray_kills_the_dead_drivers_actors(tmp_path, reaper):
    """``address=`` a running cluster: Ray kills the actors whose owner (the driver) died; the cluster stays."""
    temp = tempfile.mkdtemp(prefix="rdl", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}  # as README's clusters: token auth on
    port, client_port, dashboard_port = _free_ports(3)
    head = subprocess.Popen(
        [
            os.path.join(os.path.dirname(sys.executable), "ray"),
            "start",
            "--head",
            "--block",
            "--num-cpus",
            "2",
            "--port",
            str(port),
            # No fixed port (`ray start --head` has its client server on 10001, its agent on 52365, its workers on
            # 10002-19999, and checks 8265 is free even with no dashboard): ports the kernel picks, or free ones
            # where Ray takes no 0.
            "--ray-client-server-port",
            str(client_port),
            "--dashboard-port",
            str(dashboard_port),
            "--dashboard-agent-listen-port",
            "0",
            "--min-worker-port",
            "0",
            "--max-worker-port",
            "0",
            "--include-dashboard",
            "false",
            "--temp-dir",
            temp,
            "--disable-usage-stats",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "head.log").open("w"),
        env={**_env(), **auth},
        start_new_session=True,
    )
    reaper.append(head.pid)  # `ray stop` would stop every Ray instance of this user: this one goes by its pids
    try:
        # Started at once: its imports overlap the head's start, and ray.init waits for the head's GCS.
        folder, log = tmp_path / "ck", tmp_path / "driver.log"
        driver = _driver(folder, tmp_path / "unused.pt", "fresh", f"127.0.0.1:{port}", log, auth)
        reaper.append(driver.pid)
        _, workers = _kill_driver_at(driver, folder, log, cluster_sid=head.pid)
        killed_at = time.monotonic()
        assert len(workers) == 2, _describe(workers)
        while _alive(workers) and time.monotonic() - killed_at < 30:
            time.sleep(0.1)
        gone_after = time.monotonic() - killed_at
        left = _alive(workers)
        assert not left, f"actors of the dead driver alive 30 s after its SIGKILL: {_describe(left)}"
        assert head.poll() is None, "the cluster itself must outlive the driver"
        print(f"\nexternal cluster: {len(workers)} actor processes gone {gone_after:.1f} s after the driver's SIGKILL")
    finally:
        shutil.rmtree(temp, ignore_errors=True)
