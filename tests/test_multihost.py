"""raympi across hosts: three network-namespace hosts (tests/netns.py), each a Ray node.

The head runs in host 0 with the driver; hosts 1 and 2 join with ``ray start --address``,
token authentication on.  One worker per host (one CPU each, STRICT_SPREAD), so MPI runs
over the veths (OFI/tcp, raympi's default across hosts).  Failures are real: a host's link
taken down mid-training, every process of a host killed.  The destructive tests come last
and each repairs the host it damaged.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import threading
import time

import psutil
import pytest
import torch

import netns


@pytest.fixture(scope="module", autouse=True)
def namespaces_available():
    """Checked when the module's tests run, not when it is imported (collecting creates nothing)."""
    why = netns.unavailable()
    if why:
        pytest.skip(f"multi-host tests: {why}")


DRIVER = pathlib.Path(__file__).with_name("multihost_driver.py")
OPTIONS = dict(epochs=2, batch_size=32, checkpoint_every=10, seed=1, step_timeout_s=4.0, restart_timeout_s=20.0)
SPREAD = dict(workers=3, min_workers=2, placement_strategy="STRICT_SPREAD", resources_per_worker={"CPU": 1.0})
DRIVER_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def hosts(request):
    """Three namespace hosts running one Ray cluster; torn down (processes by id, links, namespaces) at the end."""
    cluster = netns.NetnsCluster(3)
    request.addfinalizer(cluster.teardown)
    cluster.create().start_ray()
    return cluster


def drive(cluster: netns.NetnsCluster, runs: list[dict], tmp: pathlib.Path, timeout: float = DRIVER_TIMEOUT_S) -> dict:
    """Run tests/multihost_driver.py inside host 0 and return what it saved."""
    spec, out = tmp / "spec.json", tmp / "out.pt"
    spec.write_text(json.dumps({"address": cluster.address, "runs": runs}))
    done = cluster.python(str(DRIVER), str(spec), str(out), timeout=timeout)
    (tmp / "driver.log").write_text(done.stdout + done.stderr)
    return torch.load(out, weights_only=False)


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def when_checkpoint(folder: pathlib.Path, step: int, action, timeout: float = 120.0) -> dict:
    """Run ``action()`` once the checkpoint of ``step`` exists; the returned dict gets its wall time."""
    fired: dict = {}

    def wait_then_act():
        deadline = time.monotonic() + timeout
        while not (folder / f"step-{step:08d}").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        fired["time"] = time.time()
        action()

    threading.Thread(target=wait_then_act, daemon=True).start()
    return fired


@pytest.fixture(scope="module")
def reference(hosts, tmp_path_factory):
    """The same training on one host (one worker) and spread over three hosts (one worker each).

    Meanwhile (Ray takes 20 s to give up) a driver with a wrong token tries to connect.
    """
    tmp = tmp_path_factory.mktemp("reference")
    code = f"import ray; ray.init(address={hosts.address!r}, logging_level='ERROR')"
    intruder = subprocess.Popen(
        hosts.head.exec(netns.PYTHON, "-c", code),
        env={**hosts.env(), "RAY_AUTH_TOKEN": "0" * 64},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        results = drive(
            hosts,
            [
                {"name": "one_host", "options": {**OPTIONS, "workers": 1, "checkpoint_dir": str(tmp / "one")}},
                # every namespace host names its link eth0: FI_TCP_IFACE=eth0 on every rank
                {
                    "name": "three_hosts",
                    "options": {
                        **OPTIONS,
                        **SPREAD,
                        "checkpoint_dir": str(tmp / "three"),
                        "mpi": {"interface": "eth0"},
                    },
                },
            ],
            tmp,
        )
        results["intruder"] = (intruder.wait(timeout=90), intruder.stdout.read())
    finally:
        intruder.kill()
    return results


def test_cluster_is_three_hosts_with_token_auth(hosts, reference):
    assert sorted(hosts.alive_nodes()) == [h.ip for h in hosts.hosts]
    rc, output = reference["intruder"]  # a driver with the wrong token is refused
    assert rc != 0 and "token" in output.lower(), output[-2000:]


def test_three_hosts_match_one_host(reference):
    one, three = reference["one_host"], reference["three_hosts"]
    assert sorted(reference["nodes"]) == ["10.213.0.10", "10.213.0.11", "10.213.0.12"]
    assert reference["spans_hosts"]  # so netmod "auto" chose OFI/tcp for every rank and replacement
    assert three["restarts"] == [] and one["restarts"] == []
    assert {m["world_size"] for m in three["metrics"]} == {3}
    assert len(three["metrics"]) == len(one["metrics"]) == 2 * 2048 // 32
    assert max_diff(three["params"], one["params"]) < 1e-4


def _recovered(result: dict, fired: dict, reference: dict) -> dict:
    """Common checks after a host failure; returns the restart record with measured latencies."""
    assert [r["kind"] for r in result["restarts"]][:1] in (["hung"], ["worker_lost"]), result["restarts"]
    record = result["restarts"][0]
    assert record["world_before"] == 3 and record["world_after"] == 2, record
    assert record["restored_step"] >= 20, record
    steps = [m["step"] for m in result["metrics"]]
    assert steps == list(range(1, 2 * 2048 // 32 + 1))
    assert result["metrics"][-1]["world_size"] == 2
    assert max_diff(result["params"], reference["three_hosts"]["params"]) < 1e-4
    after = [m["time"] for m in result["metrics"] if m["time"] > fired["time"] and m["world_size"] == 2]
    record["detect_s"] = record["time"] - fired["time"]
    record["failure_to_next_step_s"] = min(after) - fired["time"]
    print(
        f"\n{record['kind']}: detected {record['detect_s']:.2f} s after the failure, path {record['path']}, "
        f"recovery {record.get('recovery_s', float('nan')):.2f} s, "
        f"failure -> next step {record['failure_to_next_step_s']:.2f} s "
        f"{record.get('warm_skipped', '')}{record.get('warm_error', '')}"
    )
    return record


def _train_through(hosts, reference, tmp_path, name: str, victim: int, failure) -> dict:
    """Train on the three hosts, inflict ``failure(victim)`` after the checkpoint of step 20, repair; the record."""
    folder = tmp_path / "ck"
    fired = when_checkpoint(folder, 20, lambda: failure(victim))
    try:
        result = drive(
            hosts, [{"name": name, "options": {**OPTIONS, **SPREAD, "checkpoint_dir": str(folder)}}], tmp_path
        )[name]
    finally:
        hosts.repair(victim)
    return _recovered(result, fired, reference)


def test_cut_link_detected_within_step_deadline_and_training_finishes(hosts, reference, tmp_path):
    record = _train_through(hosts, reference, tmp_path, "cut", 2, hosts.cut)
    assert record["kind"] == "hung", record
    # the cut-off rank, found by a ping once its chunk was late (or, at the latest, at step_timeout_s)
    assert ("stopped answering" in record["cause"] or "step_timeout_s=4" in record["cause"]) and len(
        record["ranks"]
    ) == 1, record
    # noticed within the step deadline (plus the 2 s ping that finds the silent rank and a margin)
    assert record["detect_s"] < OPTIONS["step_timeout_s"] + 2 + 3, record


def test_node_loss_recovered(hosts, reference, tmp_path):
    record = _train_through(hosts, reference, tmp_path, "lost", 1, hosts.kill_host)
    assert record["kind"] in ("worker_lost", "hung"), record
    assert record["detect_s"] < 15, record


def test_teardown_leaves_nothing(hosts):
    pids = [pid for h in hosts.hosts for pid in h.pids()]
    assert pids  # the Ray nodes are running before
    hosts.teardown()
    assert hosts.leftovers() == []
    alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], alive
