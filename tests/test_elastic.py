"""Elastic fault tolerance on a real multi-node Ray cluster (ray.cluster_utils.Cluster), real MPI.

Failures are real: a node removed (its raylet and processes killed), a worker process
killed with SIGKILL or stopped with SIGSTOP, an exception in the user's model.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import re
import signal
import sys
import threading
import time
from unittest import mock

import psutil
import pytest
import torch
from ray import cloudpickle
from torch import nn

import procs
from time_limits import limit_s  # a deadline of 2 quiet cores, stretched by the load
import raympi
from raympi.exceptions import CapacityError, RestartsExhaustedError, TrainingError

# Each test takes under 40 s (its half's first also starts the cluster: ~30 s), measured beside other jobs (load 7-16
# on 2 cores): 120 s each on 2 quiet cores, stretched by the load (tests/time_limits.py), not the suite's 300.
pytestmark = pytest.mark.timeout(120)

N = 2048
OPTIONS = dict(
    epochs=4,
    batch_size=32,
    checkpoint_every=10,
    progress=False,
    seed=1,
    optimizer=raympi.optim.sgd(0.05, momentum=0.9),
    # Roomy: on a loaded machine (both halves of this module side by side, a sampler) a rank went 4 s without a
    # step and a run saw an unexpected "hung" restart before its real failure.  The hang test sets 4 s itself.
    step_timeout_s=10.0,
    restart_timeout_s=20.0,
)


@pytest.fixture(scope="module")
def cluster():
    """A head node with no CPUs (the driver) and three single-CPU worker nodes."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    # No dashboard, no fixed port: a Cluster's head takes Ray's 8265 (dashboard) and 52365 (its agent), as the
    # other half of this module may at the same time in the other test process; its worker nodes pick theirs.
    head = {"num_cpus": 0, "include_dashboard": False, "dashboard_port": None, "dashboard_agent_listen_port": 0}
    c = Cluster(initialize_head=True, head_node_args=head)
    c.workers = [c.add_node(num_cpus=1) for _ in range(3)]
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level="ERROR")
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module", autouse=True)
def fits_keep_their_workers(cluster):
    """The module's fits take the processes the last fit of their shape kept (``keep_workers``, README): a
    failure is recovered in workers that trained a run before, as in a user's notebook, and a test pays for its
    failure, not for starting processes and importing torch again (each test's first fit of a new shape still
    starts afresh: the tests are ordered so that shapes follow one another).  After the module: none is left."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAYMPI_KEEP_WORKERS", "1")  # fit's default (a driver subprocess on its own Ray keeps none)
        yield
    raympi.release_workers()
    _only_kept_workers_alive()


def _kept_pids() -> set[int]:
    """The processes of the workers and spares a fit kept for the next one."""
    import ray

    from raympi.driver import pool

    pids = set()
    for entry in pool._parked:
        for actor in entry.actors + entry.spares:
            try:
                pids.add(ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30))
            except ray.exceptions.RayError:  # gone with its node (a test removed it): nothing is left of it
                pass
    return pids


def _only_kept_workers_alive() -> None:
    kept, deadline = _kept_pids(), time.monotonic() + 20
    while {p.pid for p in procs.workers()} != kept and time.monotonic() < deadline:
        time.sleep(0.25)
    left = {p.pid for p in procs.workers()} - kept
    assert not left and len(procs.workers()) == len(kept), f"raympi worker processes outlived the run: {left}"


@pytest.fixture(autouse=True)
def no_leftovers(cluster):
    """After every test: three live nodes again, and no raympi worker or MPI process alive but those kept for
    the next fit."""
    yield
    while len(cluster.workers) < 3:
        cluster.workers.append(cluster.add_node(num_cpus=1))
    cluster.wait_for_nodes()
    _only_kept_workers_alive()


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 20, generator=g)
    return x, (x[:, 0] + x[:, 1] > 0).long()


def _net(
    pace_s: float = 0.01, while_exists: str | None = None, hang_on: str | None = None, busy: bool = False
) -> nn.Module:
    class Slow(nn.Sequential):  # defined here so it is pickled by value: the workers cannot import tests/
        """A small MLP that takes at least ``pace_s`` a step (while the file ``while_exists`` is there, when one
        is named), so failures land mid-run on any machine; the process whose pid the file ``hang_on`` holds
        hangs in its forward (a user's bug).  ``busy``: the pace is CPU time spent, not a sleep."""

        def forward(self, x):
            if busy:  # pace_s of this thread's CPU time: a process stopped part of the time takes longer
                start = time.thread_time()
                while time.thread_time() - start < pace_s:
                    pass
            elif while_exists is None or os.path.exists(while_exists):
                time.sleep(pace_s)
            if hang_on is not None and os.path.exists(hang_on) and open(hang_on).read() == str(os.getpid()):
                time.sleep(3600)
            return super().forward(x)

    torch.manual_seed(0)
    return Slow(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))


def _when_checkpoint(folder: pathlib.Path, step: int, action, timeout: float = 120.0) -> threading.Thread:
    """Run ``action()`` once the checkpoint of ``step`` exists: a failure in the middle of training."""

    def wait_then_act():
        deadline = time.monotonic() + timeout
        while not (folder / f"step-{step:08d}").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        action()

    thread = threading.Thread(target=wait_then_act, daemon=True)
    thread.start()
    return thread


def _when_logged(text: str, action, times: int = 1) -> logging.Handler:
    """Run ``action()`` (in a thread of its own) each of the first ``times`` times the driver logs a line containing
    ``text``; ``handler.fired`` counts them."""

    class Trigger(logging.Handler):
        fired = 0

        def emit(self, record: logging.LogRecord) -> None:
            if text in record.getMessage() and self.fired < times:
                self.fired += 1
                threading.Thread(target=action, daemon=True).start()

    handler = Trigger(logging.INFO)
    logger = logging.getLogger("raympi")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return handler


def _idle_worker(watch_s: float = 1.0) -> psutil.Process:
    """The hot spare: the worker process never seen running steps while the ranks train (watched for
    ``watch_s``).  Not the newest process: Ray hands actors worker processes it started ahead, so the
    newest may well be a rank (killing its raylet was a real worker loss, an unexpected restart)."""
    ran: set[int] = set()
    deadline = time.monotonic() + watch_s
    while time.monotonic() < deadline:
        ran |= {p.pid for p in procs.workers("ray::Worker.run")}
        time.sleep(0.01)
    idle = [p for p in procs.workers() if p.pid not in ran]
    assert len(idle) == 1, f"expected one idle spare, found {[(p.pid, p.info['cmdline']) for p in idle]}"
    return idle[0]


def _signal_one_worker(sig: int) -> None:
    """Send ``sig`` to the second-oldest rank running steps in the current run."""
    os.kill(procs.training_ranks()[1].pid, sig)


def _max_diff(a, b) -> float:
    return max((a.params[k] - b.params[k]).abs().max().item() for k in a.params)


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    return raympi.fit(_net(), _data(), workers=3, checkpoint_dir=str(tmp_path_factory.mktemp("base")), **OPTIONS)


def _manifest_metrics(folder: pathlib.Path) -> list[dict]:
    import json

    out = []
    for manifest in folder.glob("step-*/manifest.json"):
        try:
            out.append(json.loads(manifest.read_text())["metrics"])
        except (OSError, ValueError):
            pass
    return out


@pytest.mark.parametrize("transport", ["mpi", "gloo"])
@pytest.mark.parametrize("sig, kind", [(signal.SIGKILL, "worker_lost"), (signal.SIGSTOP, "hung")])
def test_killed_or_hung_worker_is_recovered(cluster, uninterrupted, tmp_path, sig, kind, transport):
    """On either gradient transport: a gloo process group of the old membership is abandoned, a new one built."""
    folder = tmp_path / "ck"
    _when_checkpoint(folder, 20, lambda: _signal_one_worker(sig))
    options = {**OPTIONS, "step_timeout_s": 4.0} if sig == signal.SIGSTOP else OPTIONS
    result = raympi.fit(_net(), _data(), workers=3, checkpoint_dir=str(folder), grad_transport=transport, **options)
    assert [r["kind"] for r in result.restarts] == [kind]
    record = result.restarts[0]
    assert record["path"] == "warm" and record["steps_lost"] == 0, {
        k: record.get(k) for k in ("path", "warm_skipped", "warm_error", "cause")
    }
    assert record["world_after"] == 3 and record["restored_step"] >= 20
    assert record["recovery_s"] < 30
    if sig == signal.SIGSTOP:
        # The stopped rank, found by a ping once its chunk was late (2 s), before step_timeout_s=4 ran out.
        assert "stopped answering" in record["cause"] and len(record["ranks"]) == 1, record["cause"]
        assert record["detect_s"] < 4.0, record["detect_s"]
    assert _max_diff(result.state, uninterrupted.state) < 1e-4


@pytest.mark.parametrize("transport", ["mpi", "gloo"])
def test_a_sharded_run_loses_no_step_when_a_worker_dies(cluster, uninterrupted, tmp_path, transport):
    """shard_optimizer: the dead rank's slice of the optimizer state lives on in its buddy copy on another
    rank; the survivors and the replacement re-cut the slices and train on warm."""
    folder = tmp_path / "ck"
    _when_checkpoint(folder, 20, lambda: _signal_one_worker(signal.SIGKILL))
    result = raympi.fit(
        _net(),
        _data(),
        workers=3,
        checkpoint_dir=str(folder),
        shard_optimizer=True,
        grad_transport=transport,
        **OPTIONS,
    )
    record = result.restarts[0]
    assert record["path"] == "warm" and record["steps_lost"] == 0, record
    assert record["world_after"] == 3 and record["restored_step"] >= 20
    assert [r["step"] for r in result.metrics] == list(range(1, len(result.metrics) + 1))
    assert _max_diff(result.state, uninterrupted.state) < 1e-4


def test_a_sharded_run_goes_on_warm_after_a_node_loss_on_fewer_workers(cluster, uninterrupted, tmp_path):
    """No room for a replacement: the two survivors re-shard the three slices between them (3 -> 2)."""
    folder = tmp_path / "ck"
    lost = cluster.workers.pop()
    _when_checkpoint(folder, 20, lambda: cluster.remove_node(lost))
    result = raympi.fit(
        _net(), _data(), workers=3, min_workers=2, checkpoint_dir=str(folder), shard_optimizer=True, **OPTIONS
    )
    record = result.restarts[0]
    assert record["path"] == "warm" and record["steps_lost"] == 0, record
    assert record["world_before"] == 3 and record["world_after"] == 2
    assert result.metrics[-1]["world_size"] == 2
    assert _max_diff(result.state, uninterrupted.state) < 1e-4


def test_a_sharded_run_that_loses_both_copies_of_a_slice_restarts_from_its_checkpoint(cluster, uninterrupted, tmp_path):
    """Two of three ranks in the same step: one slice had both its copies on them. The message says so, and
    the run restarts from the newest checkpoint."""
    folder, trigger = tmp_path / "ck", tmp_path / "die"

    class TwoDie(nn.Sequential):  # the first two ranks to step once ``trigger`` exists die in that step
        def forward(self, x):
            time.sleep(0.01)
            if trigger.exists():
                for claim in (tmp_path / "claim-0", tmp_path / "claim-1"):
                    try:
                        os.close(os.open(claim, os.O_CREAT | os.O_EXCL))
                    except FileExistsError:
                        continue
                    os.kill(os.getpid(), signal.SIGKILL)
            return super().forward(x)

    torch.manual_seed(0)
    net = TwoDie(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
    _when_checkpoint(folder, 20, trigger.touch)
    result = raympi.fit(
        net, _data(), workers=3, min_workers=1, checkpoint_dir=str(folder), shard_optimizer=True, **OPTIONS
    )
    record = result.restarts[0]
    assert record["path"] == "cold" and record["restored_step"] >= 20, record
    assert "both copies are gone" in record["warm_skipped"], record
    assert "restarts from the newest checkpoint" in record["warm_skipped"], record
    assert [r["step"] for r in result.metrics] == list(range(1, len(result.metrics) + 1))
    assert _max_diff(result.state, uninterrupted.state) < 1e-4


@pytest.mark.parametrize("transport", ["mpi", "gloo"])
def test_node_loss_continues_on_fewer_workers_and_grows_back(cluster, uninterrupted, tmp_path, transport):
    folder, slow = tmp_path / "ck", tmp_path / "slow"
    slow.touch()  # the steps take 50 ms until the run has grown back: it outlasts the node's start on a loaded machine
    lost = cluster.workers.pop()
    added, done = [], threading.Event()

    def manifest_worlds() -> dict[int, int]:
        return {r["step"]: r["world_size"] for r in _manifest_metrics(folder) if "world_size" in r}

    def add_back_when_shrunk():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and 2 not in manifest_worlds().values():
            time.sleep(0.05)
        if 2 in manifest_worlds().values():
            # Cluster.add_node installs a SIGTERM handler, which only the main thread may do; and
            # Ray ties the new node's processes to the life of this thread (PR_SET_PDEATHSIG), so it waits.
            with mock.patch("ray._private.utils.set_sigterm_handler", lambda handler: None):
                added.append(cluster.add_node(num_cpus=1))
        while added and time.monotonic() < deadline:
            seen = manifest_worlds()
            shrunk = max((step for step, world in seen.items() if world == 2), default=None)
            if shrunk is not None and any(step > shrunk and world == 3 for step, world in seen.items()):
                break
            time.sleep(0.05)
        slow.unlink()
        done.wait(300)

    _when_checkpoint(folder, 20, lambda: (cluster.remove_node(lost), add_back_when_shrunk()))
    try:
        result = raympi.fit(
            _net(0.05, while_exists=str(slow)),
            _data(),
            workers=3,
            min_workers=2,
            checkpoint_dir=str(folder),
            grad_transport=transport,
            **OPTIONS,
        )
    finally:
        for node in added:
            cluster.remove_node(node)
        done.set()

    lost_record = result.restarts[0]
    assert lost_record["kind"] == "worker_lost" and lost_record["world_before"] == 3 and lost_record["world_after"] == 2
    assert lost_record["path"] == "warm", lost_record
    assert lost_record["restored_step"] >= 20 and lost_record["steps_lost"] >= 0
    assert 0 < lost_record["recovery_s"] < 30
    # capacity came back: grown to 3 again, warm (the replacement waiting for a node joins) or cold
    assert [r["kind"] for r in result.restarts[1:]] in (["replacement_ready"], ["capacity_back"]), result.restarts
    worlds = [r["world_size"] for r in result.metrics]
    assert 2 in worlds and worlds[-1] == 3
    assert [r["step"] for r in result.metrics] == list(range(1, len(result.metrics) + 1))
    assert _max_diff(result.state, uninterrupted.state) < 1e-4


def test_failed_reform_restarts_cold_from_the_survivors_state(cluster, uninterrupted, tmp_path):
    """Re-forming after a peer's death can hang (MPICH over UCX, now and then): the cold restart that
    follows starts from the survivors' state (taken while they re-formed), not the older checkpoint."""
    from raympi.driver import group as group_module
    from raympi.exceptions import FormationError

    real_form, calls = group_module.comm.form, []

    def form(*args, **kwargs):
        calls.append(kwargs.get("timeout_s"))
        if len(calls) == 2:  # the warm re-formation
            raise FormationError("injected: MPI communicator of 3 actors not formed within timeout_s=5 s")
        return real_form(*args, **kwargs)

    folder = tmp_path / "ck"
    _when_checkpoint(folder, 20, lambda: _signal_one_worker(signal.SIGKILL))
    with mock.patch.object(group_module.comm, "form", form):
        result = raympi.fit(_net(), _data(), workers=3, checkpoint_dir=str(folder), **OPTIONS)
    record = result.restarts[0]
    assert record["path"] == "cold" and record.get("from") == "survivors", record
    assert "re-forming failed" in record["warm_skipped"] and record["steps_lost"] == 0, record
    assert calls[1] < OPTIONS["restart_timeout_s"], calls  # re-forming has its own short deadline
    assert [r["step"] for r in result.metrics] == list(range(1, len(result.metrics) + 1))
    assert _max_diff(result.state, uninterrupted.state) < 1e-4


def _hangs_while_starting(marker: pathlib.Path) -> object:
    """An attribute for a model: unpickled in a worker (as it starts), it stops that process with SIGSTOP,
    once per ``marker`` (the first worker to create it); the driver never unpickles it."""
    driver = os.getpid()

    def unpickled(marker: str = str(marker)) -> None:
        if os.getpid() != driver:
            try:
                os.mkdir(marker)
            except FileExistsError:
                return
            os.kill(os.getpid(), signal.SIGSTOP)

    class HangsOnce:  # defined here so it is pickled by value: the workers cannot import tests/
        def __reduce__(self):
            return (unpickled, ())

    return HangsOnce()


def test_a_worker_hung_while_starting_is_found_by_its_peers_and_the_start_tried_again(cluster, uninterrupted, tmp_path):
    """A starting worker answers no ping (no thread of its own yet): once the others have started, one still
    starting four times as long (at least 30 s) is hung, long before startup_timeout_s; the run starts again
    and ends as if nothing happened.  (A chaos run lost a cold restart to a worker stopped as it started:
    found only at startup_timeout_s=120 s, past restart_timeout_s=60 s.)"""
    net = _net()
    net.hangs = _hangs_while_starting(tmp_path / "stopped")
    result = raympi.fit(net, _data(), workers=3, checkpoint_dir=str(tmp_path / "ck"), **OPTIONS)
    assert (tmp_path / "stopped").is_dir()  # a worker did stop
    [record] = result.restarts
    assert record["kind"] == "hung" and record["phase"] == "starting", record
    assert "still starting after" in record["cause"] and record["path"] == "cold", record
    assert [r["step"] for r in result.metrics] == list(range(1, len(result.metrics) + 1))
    assert _max_diff(result.state, uninterrupted.state) < 1e-4


class NoisyData(torch.utils.data.Dataset):
    """_data() with a random-noise augmentation drawn from torch's global generator (as torchvision's are)."""

    def __init__(self) -> None:
        self.x, self.y = _data()

    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(20), self.y[i]


def test_killed_worker_with_random_augmentation_ends_on_the_uninterrupted_run(cluster, uninterrupted, tmp_path):
    """The augmentation of each sample is seeded per (seed, epoch, sample): a restart replays it exactly."""
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests/
    options = {**OPTIONS, "epochs": 2}
    base = raympi.fit(_net(), NoisyData(), workers=3, checkpoint_dir=str(tmp_path / "base"), **options)
    folder = tmp_path / "ck"
    _when_checkpoint(folder, 20, lambda: _signal_one_worker(signal.SIGKILL))
    result = raympi.fit(_net(), NoisyData(), workers=3, checkpoint_dir=str(folder), **options)
    assert [r["kind"] for r in result.restarts] == ["worker_lost"], result.restarts
    assert _max_diff(result.state, base.state) < 1e-4
    # the augmentation did change the training: the un-augmented run (same seed, same batches) saw other losses
    plain, noisy = [m["loss"] for m in uninterrupted.metrics[: len(base.metrics)]], [m["loss"] for m in base.metrics]
    assert max(abs(a - b) for a, b in zip(plain, noisy)) > 1e-3, (plain[:5], noisy[:5])


def test_warm_path_that_cannot_be_carried_out_falls_back_to_cold(cluster, uninterrupted, tmp_path, monkeypatch):
    from raympi.driver import recovery

    def decline(*args, **kwargs):
        raise recovery.WarmSkipped("declined by the test")

    monkeypatch.setattr(recovery, "warm", decline)
    folder = tmp_path / "ck"
    _when_checkpoint(folder, 20, lambda: _signal_one_worker(signal.SIGKILL))
    result = raympi.fit(_net(), _data(), workers=3, checkpoint_dir=str(folder), **OPTIONS)
    record = result.restarts[0]
    assert record["path"] == "cold" and record["warm_skipped"] == "declined by the test", record
    assert record["kind"] == "worker_lost" and record["restored_step"] >= 20 and record["world_after"] == 3
    assert [r["step"] for r in result.metrics] == list(range(1, len(result.metrics) + 1))
    assert _max_diff(result.state, uninterrupted.state) < 1e-4


def test_sigterm_to_a_worker_checkpoints_then_regroups(cluster, uninterrupted, tmp_path):
    folder = tmp_path / "ck"
    _when_checkpoint(folder, 20, lambda: _signal_one_worker(signal.SIGTERM))
    result = raympi.fit(_net(), _data(), workers=3, checkpoint_dir=str(folder), **OPTIONS)
    assert [r["kind"] for r in result.restarts] == ["preempted"]
    record = result.restarts[0]
    assert record["steps_lost"] == 0 and record["restored_step"] > 20
    assert (folder / f"step-{record['restored_step']:08d}").exists() or record["restored_step"] < result.metrics[-1][
        "step"
    ]
    assert _max_diff(result.state, uninterrupted.state) < 1e-4


def test_user_exception_fails_fast_without_restart(cluster, tmp_path):
    class Picky(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))

        def forward(self, x):
            if (x[:, 0] == 999).any():
                raise ValueError("sample 999 is poisoned")
            return self.net(x)

    x, y = _data()
    x[1500, 0] = 999  # reached some way into the first epoch, on one rank only
    start = time.monotonic()
    with pytest.raises(TrainingError, match=r"rank \d of \d on \S+ raised ValueError: sample 999 is poisoned") as info:
        raympi.fit(Picky(), (x, y), workers=3, checkpoint_dir=str(tmp_path), **OPTIONS)
    assert "Traceback on rank" in str(info.value) and "in forward" in str(info.value)
    assert time.monotonic() - start < 60


def test_more_failures_than_max_restarts(cluster, tmp_path):
    folder = tmp_path / "ck"
    _when_checkpoint(folder, 20, lambda: _signal_one_worker(signal.SIGKILL))
    with pytest.raises(RestartsExhaustedError, match="max_restarts=0.*resume=True"):
        raympi.fit(_net(), _data(), workers=3, checkpoint_dir=str(folder), **{**OPTIONS, "max_restarts": 0})
    assert raympi.load_checkpoint(str(folder)).step.item() >= 20


def test_cluster_below_min_workers(cluster, tmp_path):
    folder = tmp_path / "ck"
    lost = cluster.workers.pop()
    _when_checkpoint(folder, 20, lambda: cluster.remove_node(lost))
    start = time.monotonic()
    with pytest.raises(
        CapacityError, match=r"fewer than min_workers=3, and no way forward was found within restart_timeout_s=3 s"
    ):
        raympi.fit(_net(), _data(), workers=3, checkpoint_dir=str(folder), **{**OPTIONS, "restart_timeout_s": 3.0})
    assert time.monotonic() - start < 90
    assert raympi.load_checkpoint(str(folder)).step.item() >= 20


def test_hot_spares_take_killed_workers_places_twice_in_a_row(cluster, uninterrupted, tmp_path):
    """Two workers on three one-CPU nodes: the third CPU holds a hot spare.  Each time a spare has joined the
    standby communicator a worker is killed, twice: each time a spare takes its place with no new MPI connection
    (the second spare started after the first restart and joined the standby communicator derived then)."""
    folder = tmp_path / "ck"
    handler = _when_logged("is standby rank", lambda: _signal_one_worker(signal.SIGKILL), times=2)
    try:  # paced at 100 ms a step: both spares start and join long before the last step, on any machine
        result = raympi.fit(_net(0.1), _data(), workers=2, checkpoint_dir=str(folder), **OPTIONS)
    finally:
        logging.getLogger("raympi").removeHandler(handler)
    assert handler.fired == 2
    assert [r["kind"] for r in result.restarts] == ["worker_lost", "worker_lost"], result.restarts
    for record in result.restarts:
        assert record["path"] == "warm" and record["spare"] is True and record["world_after"] == 2, record
        assert record["reformed"] == "derived", record  # from the standby communicator: no new connection
        assert record["steps_lost"] == 0 and {"detect_s", "reform_s", "first_step_s", "recovery_s"} <= set(record)
    assert _max_diff(result.state, uninterrupted.state) < 1e-4


def test_a_stopped_worker_is_replaced_by_a_spare_first_and_labelled_hung_after(cluster, uninterrupted, tmp_path):
    """Act first, label after: a SIGSTOPped rank is replaced by the hot spare as soon as its pings go unanswered,
    without waiting for Ray's word on whether its process died; that word (none: the process lives, stopped) labels
    the restart afterwards.  The stopped process is killed once labelled: none is left behind."""
    folder = tmp_path / "ck"
    stopped: list[int] = []

    def stop_one() -> None:
        stopped.append(procs.training_ranks()[1].pid)
        os.kill(stopped[0], signal.SIGSTOP)

    handler = _when_logged("is standby rank", stop_one)
    try:
        result = raympi.fit(_net(0.1), _data(), workers=2, checkpoint_dir=str(folder), **OPTIONS)
    finally:
        logging.getLogger("raympi").removeHandler(handler)
    assert handler.fired
    (record,) = result.restarts
    assert record["kind"] == "hung" and "its process was alive but silent" in record["cause"], record
    assert record["path"] == "warm" and record["spare"] is True and record["steps_lost"] == 0, record
    deadline = time.monotonic() + 10
    while psutil.pid_exists(stopped[0]) and time.monotonic() < deadline:
        if psutil.Process(stopped[0]).status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.1)
    assert not psutil.pid_exists(stopped[0]) or psutil.Process(stopped[0]).status() == psutil.STATUS_ZOMBIE
    assert _max_diff(result.state, uninterrupted.state) < 1e-4


def test_a_rank_stuck_in_forward_is_named_with_its_stack_and_replaced_warm(cluster, uninterrupted, tmp_path):
    """A rank stuck in a ``time.sleep`` inside ``forward`` still answers pings (its health thread does), so the
    step deadline finds it; then it is the one outside any collective while its peer waits in one: only it is
    replaced (by the hot spare, warm, no step lost), and the run's folder holds every rank's stack, its own
    showing the frame it is stuck in."""
    folder, flag = tmp_path / "ck", tmp_path / "hang-on"

    def hang_one() -> None:
        flag.write_text(str(procs.training_ranks()[1].pid))

    handler = _when_logged("is standby rank", hang_one)
    try:
        result = raympi.fit(
            _net(0.05, hang_on=str(flag)),
            _data(),
            workers=2,
            checkpoint_dir=str(folder),
            **{**OPTIONS, "step_timeout_s": 4.0},
        )
    finally:
        logging.getLogger("raympi").removeHandler(handler)
    assert handler.fired
    (record,) = result.restarts
    # (the hung process is the second-oldest one running steps: rank 0 or 1, as Ray handed out its processes)
    assert record["kind"] == "hung" and record["ranks"] in ([0], [1]), record
    stuck, peer = record["ranks"][0], 1 - record["ranks"][0]
    assert "outside any collective while their peers wait in one" in record["cause"], record["cause"]
    assert f"rank {stuck}: compute" in record["cause"] and f"rank {peer}: collective" in record["cause"], record
    assert record["path"] == "warm" and record["spare"] is True and record["steps_lost"] == 0, record
    report = pathlib.Path(record["report"]).read_text()
    own = report[report.index(f"rank {stuck} (") :]
    own = own[: own.index(f"rank {peer} (")] if stuck == 0 else own
    assert "in forward" in own and "test_elastic.py" in own, report
    assert _max_diff(result.state, uninterrupted.state) < 1e-4


def test_a_rank_slowed_down_for_real_is_evicted_for_a_spare_with_no_step_lost(cluster, uninterrupted, tmp_path):
    """One rank is stopped two thirds of the time (SIGSTOP/SIGCONT, 100 ms / 50 ms: its compute takes 3x as long,
    as on a throttled node): its compute per step, against its peer's (the rule at 2x), marks it a straggler for two
    chunks in a row, and the hot spare on another node takes its place through the warm path: no step lost, no
    failure counted, the parameters those of the uninterrupted run.  Every chunk's times per rank are in ranks.jsonl."""
    folder, done = tmp_path / "ck", threading.Event()
    slowed: list[int] = []

    def duty_cycle() -> None:
        slowed.append(procs.training_ranks()[1].pid)
        while not done.is_set():
            try:
                os.kill(slowed[0], signal.SIGSTOP)
                time.sleep(0.1)
                os.kill(slowed[0], signal.SIGCONT)
                time.sleep(0.05)
            except ProcessLookupError:  # evicted: its process is gone
                return

    handler = _when_logged("is standby rank", duty_cycle)
    try:
        result = raympi.fit(
            _net(0.02, busy=True),
            _data(),
            workers=2,
            checkpoint_dir=str(folder),
            # 3x slower against a rule of 2x: a margin for the machine's noise (at the default 3x it was marginal)
            **{**OPTIONS, "straggler_factor": 2.0, "straggler_chunks": 2, "max_restarts": 0},
        )
    finally:
        done.set()
        logging.getLogger("raympi").removeHandler(handler)
        with contextlib.suppress(ProcessLookupError, IndexError):
            os.kill(slowed[0], signal.SIGCONT)
    assert handler.fired
    (record,) = result.restarts
    # (the slowed process is the second-oldest one running steps: rank 0 or 1, as Ray handed out its processes)
    assert record["kind"] == "straggler" and len(record["ranks"]) == 1, record
    assert "computed" in record["cause"] and "slower than the median of their peers" in record["cause"], record["cause"]
    assert record["path"] == "warm" and record["spare"] is True and record["steps_lost"] == 0, record
    assert _max_diff(result.state, uninterrupted.state) < 1e-4
    lines = [json.loads(line) for line in (folder / "ranks.jsonl").read_text().splitlines()]
    assert sum(line["steps"] for line in lines) >= result.metrics[-1]["step"]
    assert all(len(line["compute_s"]) == line["world"] == 2 for line in lines)


def _node_of(pid: int, cluster):
    """The cluster's worker node whose raylet started the process ``pid``."""
    raylet = psutil.Process(pid).parent()
    return next(n for n in cluster.workers if n.all_processes["raylet"][0].process.pid == raylet.pid)


def test_a_drained_node_loses_no_step_and_is_then_removed(cluster, uninterrupted, tmp_path):
    """A spot notice: Ray is asked to drain the node of a rank (``ray drain-node --reason
    DRAIN_NODE_REASON_PREEMPTION``, 60 s deadline).  The driver moves that rank to the hot spare on another node
    through the warm path before the deadline (a planned migration: checkpoint first, no step lost, no failure
    counted); the node is then removed while training goes on, which costs nothing more."""
    from raympi.driver import drains

    folder, drained, removed = tmp_path / "ck", [], threading.Event()

    def drain_a_rank_node() -> None:
        node = _node_of(procs.training_ranks()[1].pid, cluster)
        drains.drain_node(node.node_id, "spot instance reclaimed (test)", deadline_s=60)
        drained.append(node)

    class RemoveOnceMoved:
        def on_restart(self, record) -> None:
            if record["kind"] == "node_drain" and drained:
                cluster.workers.remove(drained[0])
                threading.Thread(target=lambda: (cluster.remove_node(drained[0]), removed.set()), daemon=True).start()

    handler = _when_logged("is standby rank", drain_a_rank_node)  # once the spare is in the standby communicator
    try:
        result = raympi.fit(
            _net(0.03),
            _data(),
            workers=2,
            checkpoint_dir=str(folder),
            callbacks=[RemoveOnceMoved()],
            **{**OPTIONS, "max_restarts": 0},
        )
    finally:
        logging.getLogger("raympi").removeHandler(handler)
        if drained and drained[0] in cluster.workers:
            cluster.workers.remove(drained[0])
            cluster.remove_node(drained[0])
    assert drained and removed.wait(limit_s(30))
    (record,) = result.restarts  # the removal of the emptied node cost nothing
    assert record["kind"] == "node_drain" and len(record["ranks"]) == 1, record
    assert record["nodes"] == [drained[0].node_id] and "being drained" in record["cause"], record
    assert record["path"] == "warm" and record["spare"] is True and record["steps_lost"] == 0, record
    assert [m["step"] for m in result.metrics] == list(range(1, len(result.metrics) + 1))
    assert result.metrics[-1]["world_size"] == 2
    assert _max_diff(result.state, uninterrupted.state) < 1e-4


def test_a_drained_node_with_no_room_elsewhere_goes_on_with_fewer_workers(cluster, uninterrupted, tmp_path):
    """Three ranks on the three nodes and no spare: the rank on the draining node leaves at a checkpoint, and the
    two others go on without it (min_workers=2), warm, no step lost; no replacement is started on that node."""
    from raympi.driver import drains

    folder, drained = tmp_path / "ck", []

    def drain_a_rank_node() -> None:
        node = _node_of(procs.training_ranks(least=3)[2].pid, cluster)
        drains.drain_node(node.node_id, "spot instance reclaimed (test)", deadline_s=60)
        drained.append(node)

    _when_checkpoint(folder, 20, drain_a_rank_node)
    try:
        result = raympi.fit(
            _net(0.03), _data(), workers=3, min_workers=2, spares=0, checkpoint_dir=str(folder), **OPTIONS
        )
    finally:
        for node in drained:
            cluster.workers.remove(node)
            cluster.remove_node(node)
    assert drained
    (record,) = result.restarts
    assert record["kind"] == "node_drain" and record["path"] == "warm" and record["steps_lost"] == 0, record
    assert record["world_before"] == 3 and record["world_after"] == 2 and record["spare"] is False, record
    assert result.metrics[-1]["world_size"] == 2
    assert _max_diff(result.state, uninterrupted.state) < 1e-4


def test_a_worker_killed_while_a_spare_joins_is_recovered(cluster, uninterrupted, tmp_path):
    """A worker killed the moment a hot spare starts joining the standby communicator (the join is cut
    short, its members part-way through or not started): the run recovers, loses nothing, and ends on
    the uninterrupted run's parameters; the spare of the cut join is not left running."""
    folder = tmp_path / "ck"
    handler = _when_logged("joins the standby communicator", lambda: _signal_one_worker(signal.SIGKILL))
    try:
        result = raympi.fit(_net(0.06), _data(), workers=2, checkpoint_dir=str(folder), **OPTIONS)
    finally:
        logging.getLogger("raympi").removeHandler(handler)
    assert handler.fired
    failures = [r for r in result.restarts if r["kind"] == "worker_lost"]
    assert len(failures) == 1 and failures[0]["steps_lost"] == 0, result.restarts
    assert result.restarts[-1]["world_after"] == 2, result.restarts
    assert _max_diff(result.state, uninterrupted.state) < 1e-4


def test_a_worker_dying_in_evaluation_is_recovered_and_the_evaluation_done_again(cluster, uninterrupted, tmp_path):
    """Evaluation is a step like the others: the first rank to evaluate dies there (SIGKILL from inside
    its metric); the survivor's abandoned sum is an infrastructure failure, not the user's error, and
    after the restart the evaluation of that step runs again: nothing is lost."""
    marker, driver = str(tmp_path / "died"), os.getpid()

    def dies_once(outputs, targets):
        if os.getpid() == driver:  # fit tries the metric on a sample first, in the driver
            return torch.tensor(0.0)
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return torch.tensor(0.0)
        os.kill(os.getpid(), signal.SIGKILL)

    result = raympi.fit(
        _net(),
        _data(),
        workers=2,
        eval_dataset=_data(),
        metrics={"dies_once": dies_once},
        checkpoint_dir=str(tmp_path / "ck"),
        **OPTIONS,
    )
    assert [(r["kind"], r["path"]) for r in result.restarts] == [("worker_lost", "warm")], result.restarts
    evaluated = [m["step"] for m in result.metrics if "eval_loss" in m]
    assert evaluated == [64, 128, 192, 256], evaluated  # the first one too, done again after the restart
    assert _max_diff(result.state, uninterrupted.state) < 1e-4


def test_a_worker_outliving_its_raylet_exits(cluster, uninterrupted, tmp_path):
    """The raylet of the hot spare's node killed (a crash, the OOM killer, or a node removed while the
    spare started: seen in the chaos soak): Ray leaves the spare's process idling, and no ray.kill
    reaches it any more (its node is dead to Ray). raympi's workers exit with their raylet."""
    folder = tmp_path / "ck"
    outlived, nodes, acted = [], [], threading.Event()

    def kill_the_spares_raylet():
        try:
            spare = _idle_worker()
            raylet = spare.parent()
            nodes.extend(n for n in cluster.workers if n.all_processes["raylet"][0].process.pid == raylet.pid)
            raylet.kill()
            try:  # while training goes on (nobody kills the spare meanwhile)
                spare.wait(timeout=3)
                outlived.append(False)
            except psutil.TimeoutExpired:
                outlived.append(True)
        finally:
            acted.set()

    # Once the spare has joined (it exists then, on any machine: a loaded one started it after step 100 once),
    # paced at 60 ms a step, as the other spare tests: training goes on while the spare is watched for 4 s.
    handler = _when_logged("is standby rank", kill_the_spares_raylet)
    # No hang is tested here: a deadline long enough for a machine loaded many times over (the 4 s of OPTIONS
    # ran out once on a machine loaded twice over, and the ranks were restarted for nothing).
    options = {**OPTIONS, "step_timeout_s": 30.0}
    try:
        result = raympi.fit(_net(0.06), _data(), workers=2, checkpoint_dir=str(folder), **options)
        acted.wait(60)
    finally:
        logging.getLogger("raympi").removeHandler(handler)
        for node in nodes:
            cluster.workers.remove(node)
            cluster.remove_node(node, allow_graceful=False)
    assert nodes and outlived == [False], "the spare outlived its raylet by 3 s"
    assert result.restarts == [] and _max_diff(result.state, uninterrupted.state) < 1e-4, result.restarts


def test_a_rank_slowed_down_many_times_over_is_not_taken_for_a_hung_one(cluster, tmp_path):
    """Every step suddenly 50x slower (a machine loaded many times over): the chunk in flight, sized for
    the old pace, runs far past ``step_timeout_s``, but the ranks still finish steps, which their pings
    report, so the driver waits on them: no restart."""

    class Slowing(nn.Sequential):
        def forward(self, x):
            self.calls = getattr(self, "calls", 0) + 1
            time.sleep(0.005 if self.calls <= 60 else 0.25)
            return super().forward(x)

    torch.manual_seed(0)
    options = {**OPTIONS, "epochs": 2, "step_timeout_s": 1.5, "checkpoint_every": 0}
    result = raympi.fit(
        Slowing(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2)),
        _data(),
        workers=2,
        max_steps=90,
        checkpoint_dir=str(tmp_path / "ck"),
        **options,
    )
    assert result.restarts == [], result.restarts
    assert [m["step"] for m in result.metrics] == list(range(1, 91))
    assert result.metrics[-1]["samples_per_s"] < 32 / 0.2  # the slowdown did happen


DRIVER = """
import os, sys, time, torch, raympi
from torch import nn

SAID = set()

class Slow(nn.Sequential):
    def forward(self, x):
        if os.getpid() not in SAID:  # once per process: Ray forwards the workers' lines to the driver
            SAID.add(os.getpid())
            print(f"forward in pid {os.getpid()}", flush=True)
        time.sleep(0.02)
        return super().forward(x)

torch.manual_seed(0)
x = torch.randn(2048, 20); y = (x[:, 0] > 0).long()
raympi.fit(Slow(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 2)), (x, y), workers=int(sys.argv[2]), epochs=3,
           batch_size=32, checkpoint_dir=sys.argv[1], checkpoint_every=10, address="local",
           progress=False, **({"max_steps": 6} if sys.argv[3] == "short" else {}))
print("finished", flush=True)
"""


def _driver(folder, workers: int = 2, mode: str = "long"):
    import subprocess
    import sys

    env = {**os.environ, "RAY_ADDRESS": ""}
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(folder), str(workers), mode],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


@pytest.mark.parametrize(
    "sig, words", [(signal.SIGTERM, "stopped by SIGTERM"), (signal.SIGINT, "interrupted (Ctrl-C)")]
)
def test_sigterm_or_ctrl_c_to_the_driver_checkpoints_before_exiting(tmp_path, sig, words):
    folder = tmp_path / "ck"
    driver = _driver(folder)
    deadline = time.monotonic() + 120
    while not (folder / "step-00000020").exists() and time.monotonic() < deadline and driver.poll() is None:
        time.sleep(0.05)
    if sig == signal.SIGINT:
        os.killpg(driver.pid, sig)  # as a terminal's Ctrl-C: the whole foreground group
    else:
        driver.send_signal(sig)
    out, err = driver.communicate(timeout=limit_s(90))
    assert driver.returncode != 0 and "finished" not in out
    # fit's own local Ray starts its log monitor last (raympi/driver/local_ray.py): both ranks' lines came
    assert len(set(re.findall(r"pid=(\d+)\)\S*\s+forward in pid \1", out))) == 2, out[-3000:]
    assert f"PreemptedError: {words} after step" in err and "resume=True" in err
    step = raympi.load_checkpoint(str(folder)).step.item()
    assert step > 20 and f"after step {step};" in err
    assert "ray/_private" not in err and "KeyboardInterrupt" not in err, err[-3000:]


@pytest.mark.timeout(300)  # its driver's own limit is 240 s
def test_more_workers_than_cores_on_a_local_run_are_oversubscribed(tmp_path):
    """... and say so in one line, even with progress=False."""
    workers = os.cpu_count() + 1
    driver = _driver(tmp_path / "ck", workers, "short")
    out, err = driver.communicate(timeout=limit_s(240))
    assert driver.returncode == 0 and "finished" in out, err[-3000:]
    assert f"warning: {workers} workers on {os.cpu_count()} CPU(s): running them oversubscribed" in err
