"""Every error raympi raises on purpose.

All of them derive from :class:`RaympiError` and are picklable (plain
``Exception`` subclasses whose only constructor argument is the message), so
they survive the trip from a Ray actor back to the driver.  Messages say what
went wrong and which setting to change.
"""

from __future__ import annotations


class RaympiError(Exception):
    """Base class of every raympi error."""


class MPIUnavailableError(RaympiError):
    """The MPI library is missing or a release known to be broken."""


class FormationError(RaympiError):
    """The MPI communicator could not be formed within its deadline."""


class ConfigError(RaympiError, ValueError):
    """A configuration value is wrong; the message names the field."""


class TrainingError(RaympiError):
    """The user's model, loss or data failed inside a training step."""


class NonFiniteLossError(TrainingError):
    """The loss became NaN or infinite."""


class RestartsExhaustedError(RaympiError):
    """Infrastructure failures happened more often than ``max_restarts`` allows."""


class CapacityError(RaympiError):
    """The cluster cannot host the requested workers."""


class WorkerLostError(RaympiError):
    """A worker actor or its node died (an infrastructure failure: fit restarts)."""


class StepTimeoutError(RaympiError):
    """A rank made no progress within ``step_timeout_s`` (a hang: fit restarts)."""


class PreemptedError(RaympiError):
    """The driver got SIGTERM; a checkpoint was written first."""


class CollectiveAborted(RaympiError):
    """A rank abandoned a collective because the driver asked it to (a peer failed)."""


def where(rank: int, world: int | None = None, host: str | None = None) -> str:
    """The header every remote error carries: ``rank r of n on HOST``."""
    return f"rank {rank}" + (f" of {world}" if world else "") + (f" on {host}" if host else "")
