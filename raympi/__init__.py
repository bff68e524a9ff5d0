"""raympi: functional data-parallel PyTorch training on Ray actors joined by MPI."""

from __future__ import annotations

import os
import sys

from raympi import _mpi
from raympi.exceptions import ConfigError, FormationError, MPIUnavailableError, RaympiError, TrainingError

__version__ = "0.1.0"

# A broken or missing MPI library is reported on import, in one line that says what to
# install.  `python -m raympi doctor` / the `raympi` script must still run to say it too.
_running_doctor = sys.argv[:1] == ["-m"] or os.path.basename(sys.argv[0] if sys.argv else "") == "raympi"
if not _running_doctor and (_reason := _mpi.problem()):
    raise MPIUnavailableError(_reason)

__all__ = ["ConfigError", "FormationError", "MPIUnavailableError", "RaympiError", "TrainingError", "__version__"]
