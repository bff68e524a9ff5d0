"""raympi: functional data-parallel PyTorch training on Ray actors joined by MPI.

The layers, bottom up: :mod:`raympi.core` (state, optimizers, pure steps; torch only),
:mod:`raympi.comm` (the MPI communicator among Ray actors), :mod:`raympi.worker` (one rank) and
:mod:`raympi.driver` (``fit``).  ``import raympi`` needs neither MPI nor Ray running: the MPI
library is checked when ``fit()`` or ``comm.form()`` first needs it.
"""

from __future__ import annotations

from typing import Any

from raympi import comm
from raympi.core import LossScaling, TrainState, make_eval_step, make_train_step, optim
from raympi.exceptions import (
    CapacityError, ConfigError, FormationError, MPIUnavailableError, NonFiniteLossError, PreemptedError, RaympiError,
    RestartsExhaustedError, StepTimeoutError, TrainingError, WorkerLostError,
)

__version__ = "0.1.0"

# The driver imports Ray: loaded on first use, so the core stays light.
_DRIVER = {"fit": "fit", "Result": "fit", "FitConfig": "config", "MPIConfig": "config", "load_checkpoint": "checkpoint"}


def __getattr__(name: str) -> Any:
    import importlib

    if name == "callbacks":
        return importlib.import_module("raympi.driver.callbacks")
    if name in _DRIVER:
        return getattr(importlib.import_module(f"raympi.driver.{_DRIVER[name]}"), name)
    raise AttributeError(f"module 'raympi' has no attribute {name!r}")


__all__ = [
    "CapacityError", "ConfigError", "FitConfig", "LossScaling", "FormationError", "MPIConfig", "MPIUnavailableError", "NonFiniteLossError",
    "PreemptedError", "RaympiError", "RestartsExhaustedError", "Result", "StepTimeoutError", "TrainState", "TrainingError",
    "WorkerLostError", "__version__", "callbacks", "comm", "fit", "load_checkpoint", "make_eval_step", "make_train_step", "optim",
]
