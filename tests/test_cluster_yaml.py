"""cluster.yaml / cluster-local.yaml pass Ray's own cluster-launcher checks, offline.

`ray up` runs ``commands._bootstrap_config``: ``prepare_config`` (merge with the
provider's defaults.yaml, merge setup commands, fill node-type worker counts),
then ``validate_config`` (Ray's ray-schema.json plus cross-field checks), then
the provider's ``bootstrap_config``.  For the local provider the whole chain is
offline, so it runs as is; for AWS the steps around ``validate_config`` call
AWS, so the test runs ``prepare_config`` + ``validate_config`` itself.
"""

from __future__ import annotations

import copy
import pathlib
import re
import tomllib

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.commands import _bootstrap_config
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = ["cluster.yaml", "cluster-local.yaml"]
MPICH_PIN = "mpich>=4.3,<5"


def load(name: str) -> dict:
    with open(ROOT / name) as f:
        return yaml.safe_load(f)


def ray_checked(config: dict) -> dict:
    """The config as `ray up` would use it, after Ray's validation (raises if invalid)."""
    config = copy.deepcopy(config)
    if config["provider"]["type"] == "local":
        return _bootstrap_config(config, no_config_cache=True)
    prepared = prepare_config(config)
    validate_config(prepared)
    return prepared


@pytest.fixture(params=FILES)
def name(request) -> str:
    return request.param


def test_ray_accepts_config(name):
    prepared = ray_checked(load(name))
    assert prepared["cluster_name"].startswith("raympi")
    assert prepared["head_node_type"] in prepared["available_node_types"]


def test_ray_rejects_unknown_top_level_key(name):
    broken = load(name)
    broken["setup_comands"] = ["echo typo"]
    with pytest.raises(jsonschema.ValidationError, match="setup_comands"):
        ray_checked(broken)


def test_ray_rejects_misspelled_node_type_field():
    broken = load("cluster.yaml")
    worker = broken["available_node_types"]["ray.worker.gpu"]
    worker["max_worker"] = worker.pop("max_workers")
    with pytest.raises(jsonschema.ValidationError, match="max_worker"):
        ray_checked(broken)


def test_ray_rejects_fewer_global_workers_than_node_minimum():
    broken = load("cluster.yaml")
    broken["max_workers"] = 1  # the GPU node type asks for min_workers=2
    with pytest.raises(ValueError, match="max_workers"):
        ray_checked(broken)


def test_every_node_installs_mpich_mpi4py_and_raympi(name):
    raw = load(name)
    prepared = ray_checked(raw)
    for key in ("head_setup_commands", "worker_setup_commands"):  # after Ray merged setup_commands in
        commands = prepared[key]
        assert any(f'"{MPICH_PIN}"' in c and re.search(r"\bmpi4py\b", c) for c in commands), (key, commands)
        # under the setup lock: hosts that share a home (NFS) must not install into one venv at once
        assert any(re.fullmatch(r"flock ~/.raympi-setup.lock pip install -e ~/raympi", c.strip()) for c in commands), (
            key,
            commands,
        )
    # The checkout that is installed: "." is the repository root when `ray up` runs there.
    assert raw["file_mounts"]["~/raympi"] == "."
    assert (ROOT / "pyproject.toml").is_file()
    # The virtualenv etc. stay out of the rsync (Ray's rsync_filter reads .gitignore).
    assert ".gitignore" in raw["rsync_filter"]
    assert ".venv/" in (ROOT / ".gitignore").read_text().split()


def test_mpich_pin_matches_pyproject():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert MPICH_PIN in deps


def test_setup_commands_same_in_both_files():
    aws, local = load("cluster.yaml"), load("cluster-local.yaml")
    assert aws["setup_commands"] == local["setup_commands"]
    assert aws["file_mounts"] == local["file_mounts"]


def test_aws_gpu_worker_type_counts():
    raw = load("cluster.yaml")
    worker = raw["available_node_types"]["ray.worker.gpu"]
    assert isinstance(worker["max_workers"], int) and worker["max_workers"] >= 1
    assert 1 <= worker["min_workers"] <= worker["max_workers"]
    assert worker["resources"]["GPU"] >= 1
    assert raw["max_workers"] == sum(t.get("max_workers", 0) for t in raw["available_node_types"].values())
    head = raw["available_node_types"][raw["head_node_type"]]
    assert "GPU" not in head["resources"]


def test_local_worker_counts():
    raw = load("cluster-local.yaml")
    assert isinstance(raw["max_workers"], int)
    prepared = ray_checked(raw)
    (node_type,) = prepared["available_node_types"].values()
    assert node_type["max_workers"] == node_type["min_workers"] == len(raw["provider"]["worker_ips"])


def test_token_auth_stays_on(name):
    raw = load(name)
    text = (ROOT / name).read_text()
    assert "RAY_AUTH_MODE=disabled" not in text
    assert raw["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    head, worker = raw["head_start_ray_commands"], raw["worker_start_ray_commands"]
    assert head[0] == worker[0] == "ray stop"
    assert "RAY_AUTH_MODE=token ray start --head --port=6379" in head[-1]
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head[-1]
    assert "RAY_AUTH_MODE=token ray start --address=$RAY_HEAD_IP:6379" in worker[-1]
    assert any("export RAY_AUTH_MODE=token" in c for c in raw["setup_commands"])
