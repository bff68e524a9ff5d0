"""raympi: functional data-parallel PyTorch training on Ray actors joined by MPI.

The layers, bottom up: :mod:`raympi.core` (state, optimizers, pure steps; torch only),
:mod:`raympi.comm` (the MPI communicator among Ray actors), :mod:`raympi.worker` (one rank) and
:mod:`raympi.driver` (``fit``).  ``import raympi`` needs neither MPI nor Ray running: the MPI
library is checked when ``fit()`` or ``comm.form()`` first needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raympi import comm
from raympi.exceptions import (
    CapacityError,
    ConfigError,
    FormationError,
    MPIUnavailableError,
    NonFiniteLossError,
    PreemptedError,
    RaympiError,
    RestartsExhaustedError,
    StepTimeoutError,
    TrainingError,
    WorkerLostError,
)

__version__ = "0.1.0"

if TYPE_CHECKING:  # what editors and type checkers see of the names loaded on first use
    from raympi.core import LossScaling, TrainState, make_eval_step, make_train_step, optim
    from raympi.driver import callbacks, tune
    from raympi.driver.checkpoint import load_checkpoint
    from raympi.driver.config import FitConfig, MPIConfig
    from raympi.driver.fit import Result, fit
    from raympi.driver.pool import release_workers

# Loaded on first use: the driver imports Ray and the core torch, and a light MPI member
# (``raympi.comm`` alone) needs neither.
_LAZY = {
    "fit": "raympi.driver.fit",
    "Result": "raympi.driver.fit",
    "FitConfig": "raympi.driver.config",
    "MPIConfig": "raympi.driver.config",
    "load_checkpoint": "raympi.driver.checkpoint",
    "release_workers": "raympi.driver.pool",
    "LossScaling": "raympi.core",
    "TrainState": "raympi.core",
    "make_eval_step": "raympi.core",
    "make_train_step": "raympi.core",
    "optim": "raympi.core",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name in ("callbacks", "tune"):
        return importlib.import_module(f"raympi.driver.{name}")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'raympi' has no attribute {name!r}")


__all__ = [
    "CapacityError",
    "ConfigError",
    "FitConfig",
    "LossScaling",
    "FormationError",
    "MPIConfig",
    "MPIUnavailableError",
    "NonFiniteLossError",
    "PreemptedError",
    "RaympiError",
    "RestartsExhaustedError",
    "Result",
    "StepTimeoutError",
    "TrainState",
    "TrainingError",
    "WorkerLostError",
    "__version__",
    "callbacks",
    "comm",
    "fit",
    "load_checkpoint",
    "make_eval_step",
    "make_train_step",
    "optim",
    "release_workers",
    "tune",
]
