"""Loading the MPI library, checking it is one that works, and initializing it.

mpi4py normally calls ``MPI_Init`` on import.  raympi turns that off so the
driver, which is never a member of a communicator, only loads the library to
read its version; workers call :func:`init` when they join a group.
"""

from __future__ import annotations

import re
from types import ModuleType
from typing import cast

from raympi.exceptions import MPIUnavailableError

INSTALL_HINT = "pip install 'mpich>=4.3,<5' 'mpi4py>=4'"


def library_version() -> str:
    """The first line of ``MPI_Get_library_version`` (loads MPI, does not initialize it)."""
    return cast(str, _load().Get_library_version().strip().splitlines()[0])


def problem() -> str | None:
    """A one-line reason why this MPI library cannot be used, or None when it is fine."""
    try:
        version = library_version()
    except MPIUnavailableError as exc:
        return str(exc)
    match = re.search(r"MPICH Version:\s*(\d+)\.(\d+)", version)
    if match and int(match.group(1)) >= 5:
        return (
            f"{version.split(':', 1)[1].strip()} is MPICH 5, whose MPI_Comm_connect/accept fails "
            f"between processes not started by mpiexec (pmodels/mpich issue 7805); "
            f"install the 4.3 series: {INSTALL_HINT}"
        )
    return None


def cuda_aware() -> str:
    """Whether the MPI library can take CUDA buffers, as far as its version string tells, in words."""
    text = _load().Get_library_version()
    configure = re.search(r"MPICH configure:\s*(.*)", text)
    if configure:
        return (
            "yes (MPICH built --with-cuda)"
            if "--with-cuda" in configure.group(1)
            else "no (MPICH built without --with-cuda): GPU gradients over MPI are staged through host memory"
        )
    if "Open MPI" in text:
        return "unknown (Open MPI: see ompi_info --parsable --all | grep mpi_built_with_cuda_support)"
    return "unknown"


def require() -> ModuleType:
    """The ``mpi4py.MPI`` module, or a readable :class:`MPIUnavailableError`."""
    reason = problem()
    if reason:
        raise MPIUnavailableError(reason)
    return _load()


def init() -> ModuleType:
    """Initialize MPI in this process (once, thread level MULTIPLE) and return ``mpi4py.MPI``."""
    MPI = require()
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    return MPI


def _load() -> ModuleType:
    try:
        import mpi4py

        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False  # MPI_Finalize is collective over connected peers: it would hang on a dead one
        from mpi4py import MPI
    except ImportError as exc:
        raise MPIUnavailableError(f"no usable MPI library ({exc}); install one: {INSTALL_HINT}") from None
    except RuntimeError as exc:  # mpi4py raises RuntimeError when libmpi cannot be loaded
        raise MPIUnavailableError(f"the MPI library failed to load ({exc}); install one: {INSTALL_HINT}") from None
    return MPI
