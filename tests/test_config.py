"""fit options: validation before anything starts, and the MPI transport environment."""

from __future__ import annotations

import pytest

from raympi.driver.config import MPIConfig, parse_config
from raympi.driver.data import epoch_order, rank_slices, steps_per_epoch
from raympi.exceptions import ConfigError


@pytest.mark.parametrize(
    "options, words",
    [
        ({"workers": 2, "batch_size": 1}, "batch_size=1 is smaller than workers=2"),
        ({"min_workers": 5, "workers": 4}, "min_workers=5 is larger than workers=4"),
        ({"step_timeout_s": 0}, "step_timeout_s"),
        ({"mpi": {"netmod": "tcp"}}, "mpi.netmod"),
        ({"compression": "int8"}, "compression"),
        ({"checkpoint_evry": 5}, "unknown option 'checkpoint_evry'"),
    ],
)
def test_bad_options_name_the_field(options, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        parse_config(**options)


def test_defaults_and_frozen():
    cfg = parse_config(workers=3)
    assert cfg.min_workers == 3 and cfg.max_restarts == 3
    with pytest.raises(Exception):
        cfg.workers = 4


def test_mpi_environment():
    assert MPIConfig().environment(multi_host=False) == {"MPIR_CVAR_CH4_NETMOD": "ucx", "UCX_RNDV_SCHEME": "am"}
    assert MPIConfig().environment(multi_host=True) == {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
    env = MPIConfig(netmod="ofi", interface="eth1", env={"FI_LOG_LEVEL": "warn"}).environment(multi_host=False)
    assert env == {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "eth1", "FI_LOG_LEVEL": "warn"}


def test_data_order_and_uneven_split():
    assert epoch_order(0, 1, 100).tolist() == epoch_order(0, 1, 100).tolist()
    assert epoch_order(0, 1, 100).tolist() != epoch_order(0, 2, 100).tolist()
    assert sorted(epoch_order(3, 0, 50).tolist()) == list(range(50))
    import torch

    parts = rank_slices(torch.arange(64), 3)
    assert [len(p) for p in parts] == [22, 21, 21] and torch.cat(parts).tolist() == list(range(64))
    assert steps_per_epoch(130, 64) == 2
    with pytest.raises(ConfigError, match="fewer than batch_size=64"):
        steps_per_epoch(10, 64)


def test_a_worker_holds_one_gpu_unless_a_share_is_named():
    from raympi.driver.capacity import worker_bundle

    assert worker_bundle(parse_config(workers=2), use_gpu=True) == {"CPU": 1.0, "GPU": 1.0}
    shared = parse_config(workers=2, resources_per_worker={"CPU": 1.0, "GPU": 0.5})
    assert worker_bundle(shared, use_gpu=True) == {"CPU": 1.0, "GPU": 0.5}  # two workers on one GPU
    assert worker_bundle(parse_config(workers=2), use_gpu=False) == {"CPU": 1.0}
