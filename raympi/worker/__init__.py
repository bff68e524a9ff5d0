"""Layer 3, the worker: the Ray actor that is one rank, and how it reads its data.

``actor``: :class:`Worker`, built from one frozen :class:`WorkerSpec`; ``loader``: reading the
user's Dataset by the indices the driver sends, seeded per sample, prefetched in processes.
"""

from raympi.worker.actor import Worker, WorkerSpec, to_tensors

__all__ = ["Worker", "WorkerSpec", "to_tensors"]
