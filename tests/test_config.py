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


# fit's signature: one keyword-only parameter per FitConfig field, the validation behind them in FitConfig.

# The parameters typed wider than FitConfig's field: what FitConfig accepts and converts (a mapping to a dict, a
# tuple to a list), and the optimizer FitConfig takes as Any to say itself what is wrong with another object.
WIDER = {"optimizer", "metrics", "resources_per_worker", "callbacks"}


def test_fit_takes_each_option_of_fit_config_as_a_keyword_only_parameter():
    import inspect
    import typing

    from raympi.driver.config import UNSET, FitConfig
    from raympi.driver.fit import fit

    params = inspect.signature(fit).parameters
    kinds = {name: p.kind for name, p in params.items()}
    assert (
        list(params)[:3] == ["model", "dataset", "workers"]
        and kinds["workers"] == inspect.Parameter.POSITIONAL_OR_KEYWORD
    )
    assert list(params)[-1] == "unknown" and kinds["unknown"] == inspect.Parameter.VAR_KEYWORD
    keyword_only = {name for name, kind in kinds.items() if kind == inspect.Parameter.KEYWORD_ONLY}
    assert keyword_only | {"workers"} == set(FitConfig.model_fields), {
        "not in fit": sorted(set(FitConfig.model_fields) - keyword_only - {"workers"}),
        "not in FitConfig": sorted(keyword_only - set(FitConfig.model_fields)),
    }
    hints = typing.get_type_hints(fit)
    for name, field in FitConfig.model_fields.items():
        default = params[name].default
        if default is UNSET:  # computed when fit runs: FitConfig's own default applies
            assert field.default_factory is not None, name
        else:
            assert field.default_factory is None and default == field.default, name
        if name not in WIDER:
            assert hints[name] == field.annotation, name


def test_help_on_fit_shows_its_options():
    import pydoc

    from raympi.driver.config import FitConfig
    from raympi.driver.fit import fit

    text = pydoc.render_doc(fit, renderer=pydoc.plaintext)
    assert "step_timeout_s: 'float' = 10.0" in text
    assert not [name for name in FitConfig.model_fields if f"{name}: " not in text]
    assert not [name for name in FitConfig.model_fields if f"``{name}``" not in fit.__doc__]  # and its groups


def test_fit_validates_before_anything_starts_and_passes_only_the_options_given(monkeypatch):
    import torch

    import raympi.driver.fit as fit_module

    seen = []
    monkeypatch.setattr(fit_module, "_fit", lambda model, dataset, cfg: seen.append(cfg))
    data = (torch.randn(8, 4), torch.randint(0, 2, (8,)))
    with pytest.raises(ConfigError, match=r"unknown option 'batch_sise' \(known options: accumulate, address, "):
        fit_module.fit(torch.nn.Linear(4, 2), data, workers=2, batch_sise=64)
    with pytest.raises(ConfigError, match="step_timeout_s: .*greater than 0"):
        fit_module.fit(torch.nn.Linear(4, 2), data, step_timeout_s=0)
    with pytest.raises(ConfigError, match="batch_size=1 is smaller than workers=2"):
        fit_module.fit(torch.nn.Linear(4, 2), data, 2, batch_size=1)
    assert not seen

    monkeypatch.setenv("RAYMPI_KEEP_WORKERS", "1")  # a default computed when fit runs
    fit_module.fit(
        torch.nn.Linear(4, 2), data, 3, spares=0, resources_per_worker={"CPU": 2}, mpi=MPIConfig(netmod="ofi")
    )
    monkeypatch.delenv("RAYMPI_KEEP_WORKERS")
    fit_module.fit(torch.nn.Linear(4, 2), data, callbacks=(print,))
    first, second = seen
    assert first.workers == 3 and first.min_workers == 3 and first.spares == 0 and first.keep_workers
    assert first.resources_per_worker == {"CPU": 2.0} and first.mpi.netmod == "ofi" and first.metrics == {}
    assert not second.keep_workers and second.callbacks == [print] and second.resources_per_worker == {"CPU": 1.0}
