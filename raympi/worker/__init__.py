"""Layer 3, the worker: the Ray actor that is one rank, and how it reads its data.

``actor``: :class:`Worker`, built from one frozen :class:`WorkerSpec`; ``loader``: reading the
user's Dataset by the indices the driver sends, seeded per sample, prefetched in processes;
``results``: what its calls return (plain values: importing them imports no torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raympi.worker.actor import Worker, WorkerSpec, to_tensors

__all__ = ["Worker", "WorkerSpec", "to_tensors"]


def __getattr__(name: str) -> Any:
    """The actor's names, loaded on first use (it imports torch)."""
    if name in __all__:
        from raympi.worker import actor

        return getattr(actor, name)
    raise AttributeError(f"module 'raympi.worker' has no attribute {name!r}")
