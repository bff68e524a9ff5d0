"""Large checkpoints: rank 0 writes the state straight to storage, the driver only commits the folder.

For a state of at least ``direct_checkpoint_bytes`` the driver never holds the state.  It makes a
temporary folder and asks rank 0, right behind the chunk of steps in flight, for the checkpoint
(:meth:`raympi.worker.Worker.checkpoint`): rank 0 copies its state, answers with a small
:class:`~raympi.worker.checkpoint_io.Snapshot`, and writes ``state.pt`` into the folder from a
background thread.  The driver's writer thread polls the write (:func:`await_write`) and, once rank 0
reports the checksum, adds ``manifest.json`` and renames the folder into place
(:meth:`~raympi.driver.checkpoint.CheckpointStore.save`'s commit), pruning as usual.  A rank 0 lost
midway costs that checkpoint only.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from raympi.exceptions import WorkerLostError

__all__ = ["DirectRequest", "await_write", "not_shared"]


@dataclasses.dataclass(frozen=True)
class DirectRequest:
    """A checkpoint asked of rank 0 that it may write itself.

    Attributes:
        actor: rank 0's actor.
        ref: the object ref of its :class:`~raympi.worker.checkpoint_io.Snapshot`.
        tmp: the temporary folder, as a path in the store's file system.
        url: the same folder as rank 0 opens it (a local path or an fsspec URL).
        rank: the rank asked (``shard_optimizer``: every rank writes its own file into ``tmp``).
    """

    actor: Any
    ref: Any
    tmp: str
    url: str
    rank: int = 0


def await_write(request: DirectRequest, step: int, timeout_s: float) -> dict[str, Any]:
    """Poll rank 0 until its write of ``step`` is done; returns its status (``sha256``, ``bytes``, ``write_s``).

    The deadline counts time without progress: a slow but moving write of many GB is waited for.

    Raises:
        WorkerLostError: rank 0 died, or wrote nothing and did not answer for ``timeout_s``.
        OSError: the write failed on storage (rank 0's error, with its errno).
        RuntimeError: the write failed otherwise.
    """
    import ray

    pause, last, since = 0.02, -1, time.monotonic()
    while True:
        try:
            status = ray.get(
                request.actor.checkpoint_status.remote(request.url),
                timeout=max(0.1, timeout_s - (time.monotonic() - since)),
            )
        except ray.exceptions.GetTimeoutError:
            raise WorkerLostError(
                f"rank {request.rank} did not answer about its checkpoint of step {step} within {timeout_s:g} s "
                "(startup_timeout_s)"
            ) from None
        except ray.exceptions.RayActorError as exc:
            raise WorkerLostError(
                f"rank {request.rank} was lost while writing the checkpoint of step {step} ({type(exc).__name__})"
            ) from None
        if status["done"]:
            if status.get("storage"):
                raise OSError(status.get("errno"), status["error"])
            if status["error"]:
                raise RuntimeError(
                    f"rank {request.rank} could not write the checkpoint of step {step}: {status['error']}"
                )
            return dict(status)
        if status["written"] != last:
            last, since = status["written"], time.monotonic()
        elif time.monotonic() - since > timeout_s:
            raise WorkerLostError(
                f"rank {request.rank}'s write of the checkpoint of step {step} made no progress for {timeout_s:g} s "
                "(startup_timeout_s)"
            )
        time.sleep(pause)
        pause = min(0.5, pause * 2)


def not_shared(note: str, root: str, size: int) -> str:
    """The warning when rank 0 cannot see ``checkpoint_dir`` and the driver writes a large state itself."""
    return (
        f"{note}: checkpoint_dir={root!r} is not storage that rank 0 shares with the driver, so the driver "
        f"writes this {size / 1e9:.2f} GB state itself, through its memory. Use a folder every node mounts "
        "(NFS) or an fsspec URL (s3://, gs://) so that rank 0 writes it, or direct_checkpoint_bytes=None "
        "to have the driver write every checkpoint without this warning"
    )
