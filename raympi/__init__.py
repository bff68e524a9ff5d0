"""raympi: functional data-parallel PyTorch training on Ray actors joined by MPI."""

from __future__ import annotations

import os
import sys

from raympi import _mpi
from raympi.exceptions import (
    CapacityError, ConfigError, FormationError, MPIUnavailableError, NonFiniteLossError, PreemptedError, RaympiError,
    RestartsExhaustedError, StepTimeoutError, TrainingError, WorkerLostError,
)

__version__ = "0.1.0"

# A broken or missing MPI library is reported on import, in one line that says what to
# install.  `python -m raympi doctor` / the `raympi` script must still run to say it too.
_running_doctor = sys.argv[:1] == ["-m"] or os.path.basename(sys.argv[0] if sys.argv else "") == "raympi"
if not _running_doctor and (_reason := _mpi.problem()):
    raise MPIUnavailableError(_reason)

from raympi import optim  # noqa: E402
from raympi._state import TrainState  # noqa: E402
from raympi._step import make_eval_step, make_train_step  # noqa: E402
from raympi.checkpoint import load_checkpoint  # noqa: E402
from raympi.config import FitConfig, MPIConfig  # noqa: E402
from raympi.fit import Result, fit  # noqa: E402

__all__ = [
    "CapacityError", "NonFiniteLossError", "PreemptedError", "RestartsExhaustedError", "StepTimeoutError", "WorkerLostError",
    "ConfigError", "FitConfig", "FormationError", "MPIConfig", "MPIUnavailableError", "RaympiError", "Result",
    "TrainState", "TrainingError", "__version__", "fit", "load_checkpoint", "make_eval_step", "make_train_step", "optim",
]
