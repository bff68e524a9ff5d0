"""Checkpoints: rank 0's state, written by the driver, never half-written.

A checkpoint is a folder ``step-00000040/``: ``state.pt`` (plain tensors, ``torch.load(weights_only=True)``)
and ``manifest.json`` (step, cursor, world size, metrics, config, SHA-256 of ``state.pt``), written under a
temporary name, fsynced, then renamed.  ``checkpoint_dir`` may be a local path or an fsspec URI.

A kill at any moment leaves no ``step-*`` folder that loads wrong, at most a hidden ``.step-*.tmp-PID``
(being written) or ``.step-*.old-PID`` (being deleted), removed by the next write once PID is gone.
A write that fails on storage (any ``OSError``: a full disk or quota, a read-only or vanished mount,
an object store's error) costs that checkpoint only: its temporary folder is removed, older ones stay
intact, and the driver warns (the folder, on a full disk the free and needed space, the checkpoint a
restart would use) and trains on.  ``wait(strict=True)`` still raises what means the state itself is
lost: rank 0 did not hand it over, or it cannot be serialized.

Each write prunes: the newest ``keep`` stay, or with a ``metric`` (``checkpoint_metric``) the ``keep`` best by
its value in the manifest's metrics and the newest (:func:`~raympi.driver.checkpoint_folders.kept`); :meth:`best`
names the best.  A resume continues from the newest either way (:meth:`CheckpointStore.latest`).

A state of at least ``direct_bytes`` never comes to the driver: rank 0 writes ``state.pt`` into a
temporary folder itself and the driver commits it (:mod:`raympi.driver.checkpoint_direct`); the
driver then keeps a :class:`~raympi.worker.checkpoint_io.StoredState` instead of the state.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import io
import json
import os
import posixpath
import queue
import threading
import warnings
from typing import Any, Literal

import ray
import torch

from raympi.core import pytree
from raympi.core.state import TrainState
from raympi.driver.checkpoint_direct import DirectRequest, await_write, not_shared
from raympi.driver.checkpoint_folders import IN_FLIGHT, AtomicFolders, ranked, remove_folder
from raympi.exceptions import ConfigError, WorkerLostError
from raympi.worker.checkpoint_io import (
    StoredState,
    fs_of,
    is_local as _is_local,
    join_trees,
    read_checkpoint as _read,
    shard_file,
    shards_digest,
    verify,
)

__all__ = ["CheckpointStore", "load_checkpoint", "CORRUPT_WARNING"]

CORRUPT_WARNING = "raympi checkpoint unusable"


class CheckpointStore(AtomicFolders):
    """The checkpoints of one run under ``root``, of which ``keep`` are kept: the newest, or with ``metric`` the
    best by it and the newest.

    ``direct_bytes``: rank 0 writes a state of at least this many bytes itself (``None``: never).
    ``metric``: a key of the manifests' ``metrics`` (the step record: ``"eval_loss"``, ``"loss"``, ...) by which
    the best are kept, lower being better with ``mode="min"``, higher with ``"max"``.

    Raises:
        ConfigError: ``root`` cannot be created or written (checked at once, before any worker starts).
    """

    def __init__(
        self,
        root: str,
        keep: int = 3,
        fetch_timeout_s: float = 60.0,
        direct_bytes: int | None = None,
        metric: str | None = None,
        mode: Literal["min", "max"] = "min",
    ) -> None:
        self.root = root.removeprefix("file://")
        self.keep = keep
        self.metric, self.mode = metric, mode
        self._scores = {}
        self.fetch_timeout_s = fetch_timeout_s  # rank 0 handing over its state (a stopped rank must not hang us)
        self.direct_bytes = direct_bytes
        self.received_bytes = 0  # state bytes the driver fetched from rank 0 (none for direct writes)
        self.fs, self._path = fs_of(root)
        self._requested: dict[str, Any] = {}  # asked of the ranks (a DirectRequest, or a list), not yet saved
        self._seq, self._warned, self._warned_metric = 0, False, False
        self._writer = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="raympi-checkpoint", initializer=_background_priority
        )
        self._pending: list[concurrent.futures.Future[str | None]] = []
        self._saved: queue.SimpleQueue[tuple[str, int, Any]] = queue.SimpleQueue()
        self._lost: queue.SimpleQueue[str] = queue.SimpleQueue()  # why a write failed, warned on the driver's thread
        try:
            self.fs.makedirs(self._path, exist_ok=True)
            probe = posixpath.join(self._path, f".write-test-{os.getpid()}")
            IN_FLIGHT.add(probe)  # not a leftover
            with self.fs.open(probe, "wb") as f:
                f.write(b"ok")
            self.fs.rm(probe)
            IN_FLIGHT.discard(probe)
        except OSError as exc:
            raise ConfigError(
                f"checkpoint_dir={root!r} is not writable ({exc.strerror or exc}): choose another checkpoint_dir"
            ) from None

    def file(self, name: str) -> str:
        """Path of a file next to the checkpoints (metrics, plot)."""
        return posixpath.join(self._path, name)

    def request(self, actor: Any, step: int) -> Any:
        """Ask rank 0 (``actor``) for its state after ``step``, queued behind the steps sent to it: an
        object ref of the state, or with ``direct_bytes`` a :class:`DirectRequest` (pass either to
        :meth:`save_async`)."""
        if self.direct_bytes is None:
            return actor.state_dict.remote()
        tmp, url = self._temporary(step)
        self._requested[tmp] = request = DirectRequest(actor, actor.checkpoint.remote(url, self.direct_bytes), tmp, url)
        return request

    def request_shards(self, actors: list[Any], step: int) -> Any:
        """``shard_optimizer``: ask every rank for its part of the state after ``step``.  With ``direct_bytes``
        set, each rank writes its own file into one temporary folder, in parallel, whatever its size (a list
        of :class:`DirectRequest`); otherwise the parts are joined in a task beside the workers (an object
        ref of the whole state).  Pass either to :meth:`save_async`."""
        if self.direct_bytes is None:
            return join_shards.remote(*[a.state_dict.remote() for a in actors])
        tmp, url = self._temporary(step)
        requests = [
            DirectRequest(a, a.checkpoint.remote(url, 0, shard_file(rank)), tmp, url, rank)
            for rank, a in enumerate(actors)
        ]
        self._requested[tmp] = requests
        return requests

    def _temporary(self, step: int) -> tuple[str, str]:
        """A new temporary folder for the checkpoint of ``step``: its path here, and its URL for the workers."""
        self._seq += 1
        tmp = posixpath.join(self._path, f".step-{step:08d}.tmp-{os.getpid()}-{self._seq}")
        IN_FLIGHT.add(tmp)
        with contextlib.suppress(OSError):  # rank 0 then cannot see it and hands the state over instead
            self.fs.makedirs(tmp, exist_ok=True)
        return tmp, tmp if _is_local(self.root) else self.fs.unstrip_protocol(tmp)

    def abandon_unsaved(self) -> None:
        """Drop the requests that will never be saved (the steps before them failed): their folders go."""
        for tmp in list(self._requested):
            del self._requested[tmp]
            self._pending.append(self._writer.submit(self._forget, tmp))

    def save_async(self, state: Any, manifest: dict[str, Any]) -> concurrent.futures.Future[str | None]:
        """Write in the background; ``state`` may be a Ray object ref (fetched by the writer) or a
        :class:`DirectRequest` (rank 0 writes, the writer commits).

        Once the checkpoint is on disk, ``(path, step, state)`` is queued for :meth:`drain_saved`
        (``state`` a :class:`StoredState` when rank 0 wrote it).
        """
        if isinstance(state, (DirectRequest, list)):
            self._requested.pop(state.tmp if isinstance(state, DirectRequest) else state[0].tmp, None)
        future = self._writer.submit(self._save_ref, state, manifest)
        self._pending.append(future)
        return future

    def drain_saved(self) -> list[tuple[str, int, dict[str, Any]]]:
        """The checkpoints written since the last call, oldest first: ``(path, step, state)``; warns of lost ones."""
        self._warn_lost()
        return _drain(self._saved)

    def _save_ref(self, state: Any, manifest: dict[str, Any]) -> str | None:
        if isinstance(state, DirectRequest):
            return self._save_direct(state, manifest)
        if isinstance(state, list):
            return self._save_shards(state, manifest)
        if not isinstance(state, dict):
            state = self._fetch(state, manifest)
        try:
            path = self.save(state, manifest)
        except OSError as exc:  # storage, not the state: warn, keep training on the previous checkpoint
            self._lost.put(f"{exc.strerror or exc}; training goes on")
            return None
        self._saved.put((path, int(manifest["step"]), state))  # handed to the driver's thread, never shared
        return path

    def _fetch(self, ref: Any, manifest: dict[str, Any]) -> Any:
        import ray

        from raympi.core import pytree
        from raympi.worker.checkpoint_io import Snapshot

        try:
            got = ray.get(ref, timeout=self.fetch_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise WorkerLostError(
                f"rank 0 did not hand over its state for step {manifest['step']} within "
                f"{self.fetch_timeout_s:g} s (startup_timeout_s)"
            ) from None
        if isinstance(got, Snapshot):
            got = got.arrays
        self.received_bytes += sum(getattr(a, "nbytes", 0) for a in pytree.leaves(got))
        return pytree.from_arrays(got)  # zero-copy views

    def _save_direct(self, request: DirectRequest, manifest: dict[str, Any]) -> str | None:
        """Commit what rank 0 writes into ``request.tmp``; a small state (or storage rank 0 cannot see) is written
        here."""
        step = int(manifest["step"])
        try:
            snapshot = self._fetch_snapshot(request, manifest)
            if snapshot.folder is None:
                self._forget(request.tmp)
                if snapshot.note and not self._warned:
                    self._warned = True
                    self._lost.put(not_shared(snapshot.note, self.root, snapshot.bytes))
                return self._save_ref(self._fetch(request.ref, manifest), manifest)
            status = await_write(request, step, self.fetch_timeout_s)
            manifest = {
                **manifest,
                "sha256": status["sha256"],
                "bytes": status["bytes"],
                "written_by": "rank 0",
                "blocked_s": snapshot.blocked_s,
                "copy_s": snapshot.copy_s,
                "write_s": status["write_s"],
            }
            path = self._commit(manifest, tmp=request.tmp)
        except WorkerLostError as exc:  # that checkpoint is lost with rank 0; the previous one stays
            self._forget(request.tmp)
            self._lost.put(f"checkpoint step-{step:08d} not written: {exc}; {self._still()}; training goes on")
            return None
        except OSError as exc:
            self._forget(request.tmp)
            why = (
                str(exc)
                if "not written" in str(exc)
                else self._why_lost(f"step-{step:08d}", exc, manifest.get("bytes", 0))
            )
            self._lost.put(f"{why}; training goes on")
            return None
        self._saved.put((path, step, StoredState(path, manifest["sha256"], manifest["bytes"])))
        return path

    def _save_shards(self, requests: list[DirectRequest], manifest: dict[str, Any]) -> str | None:
        """Commit the files every rank writes into one temporary folder; where a rank cannot see it, the parts
        are joined here and written as one state."""
        step, tmp = int(manifest["step"]), requests[0].tmp
        try:
            snapshots = [self._fetch_snapshot(r, manifest) for r in requests]
            statuses = [
                await_write(r, step, self.fetch_timeout_s) if s.folder else None for r, s in zip(requests, snapshots)
            ]
            if any(s.folder is None for s in snapshots):  # storage not shared with every rank
                parts = [
                    pytree.from_arrays(s.arrays) if s.folder is None else _read_file(self.fs, tmp, shard_file(r.rank))
                    for r, s in zip(requests, snapshots)
                ]
                self._forget(tmp)
                whole = join_trees(parts)
                path = self.save(whole, manifest)
                self._saved.put((path, step, whole))
                return path
            shards = [
                {"file": shard_file(r.rank), "sha256": st["sha256"], "bytes": st["bytes"]}
                for r, st in zip(requests, statuses)
                if st is not None
            ]
            manifest = {
                **manifest,
                "shards": shards,
                "sha256": shards_digest(shards),
                "bytes": sum(s["bytes"] for s in shards),
                "written_by": f"{len(shards)} ranks",
                "blocked_s": max(s.blocked_s for s in snapshots),
                "write_s": max(st["write_s"] for st in statuses if st is not None),
            }
            path = self._commit(manifest, tmp=tmp)
        except WorkerLostError as exc:  # that checkpoint is lost with the rank; the previous one stays
            self._forget(tmp)
            self._lost.put(f"checkpoint step-{step:08d} not written: {exc}; {self._still()}; training goes on")
            return None
        except OSError as exc:
            self._forget(tmp)
            self._lost.put(f"{self._why_lost(f'step-{step:08d}', exc, manifest.get('bytes', 0))}; training goes on")
            return None
        self._saved.put((path, step, StoredState(path, manifest["sha256"], manifest["bytes"])))
        return path

    def _fetch_snapshot(self, request: DirectRequest, manifest: dict[str, Any]) -> Any:
        import ray

        try:
            return ray.get(request.ref, timeout=self.fetch_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise WorkerLostError(
                f"rank {request.rank} did not answer the checkpoint request within {self.fetch_timeout_s:g} s "
                "(startup_timeout_s)"
            ) from None
        except ray.exceptions.RayActorError as exc:
            raise WorkerLostError(f"rank {request.rank} was lost ({type(exc).__name__})") from None

    def _forget(self, tmp: str) -> None:
        remove_folder(self.fs, tmp)
        IN_FLIGHT.discard(tmp)

    def wait(self, strict: bool = True) -> None:
        """Block until every background write is done; re-raise a failed one (``strict``) or warn about it."""
        pending, self._pending = self._pending, []
        for future in pending:
            error = future.exception()
            self._warn_lost()
            if error is not None and strict:
                raise error
            if error is not None:
                warnings.warn(
                    f"a checkpoint was lost with its worker ({type(error).__name__}); the previous one is used",
                    stacklevel=2,
                )

    def _warn_lost(self) -> None:
        for message in _drain(self._lost):
            warnings.warn(message, stacklevel=3)

    def close(self) -> None:
        """Finish the pending writes and stop the writer thread."""
        try:
            self.wait()
        finally:
            self._writer.shutdown(wait=True)

    def save(self, state: dict[str, Any], manifest: dict[str, Any]) -> str:
        """Write one checkpoint atomically; returns its folder."""
        buffer = io.BytesIO()
        torch.save(state, buffer)
        blob = buffer.getbuffer()  # no copy
        return self._commit({**manifest, "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}, blob)

    def best(self) -> str | None:
        """The folder of the kept checkpoint with the best value of ``metric`` (of equal ones the newer).

        ``None`` without a ``metric``, or where no checkpoint has a value for it; the latter is warned of
        (once), with the metrics the newest checkpoint does have, as a misspelt name would be.
        """
        if self.metric is None:
            return None
        names = self._names()
        scores = self._scores_of(names)
        first = next(iter(ranked(names, scores, self.mode)), None)
        if first is not None and scores[first] is not None:
            return self._url(first)
        if names and not self._warned_metric:
            self._warned_metric = True
            metrics = self._manifest(names[-1]).get("metrics")
            has = sorted(set(metrics) - {"step", "epoch", "time"}) if isinstance(metrics, dict) else []
            warnings.warn(
                f"checkpoint_metric={self.metric!r}: no checkpoint has a value for it (the newest's metrics: "
                f"{', '.join(has) or 'none'}), so the newest keep_checkpoints={self.keep} were kept; check its "
                "name, and that an evaluation (eval_dataset, eval_every) falls on a checkpoint's step",
                stacklevel=2,
            )
        return None

    def latest(self, stored_from: int | None = None) -> tuple[str, dict[str, Any], Any] | None:
        """``(path, manifest, state)`` of the newest valid checkpoint; broken ones are reported and skipped.

        ``stored_from``: a state of at least this many bytes is verified but left on storage (``state``
        is then a :class:`StoredState`).
        """
        for name in reversed(self._names()):
            path = posixpath.join(self._path, name)
            try:
                if stored_from is not None:
                    with self.fs.open(posixpath.join(path, "manifest.json"), "rb") as f:
                        if json.loads(f.read()).get("bytes", 0) >= stored_from:
                            manifest = verify(self.fs, path)
                            return path, manifest, StoredState(self._url(name), manifest["sha256"], manifest["bytes"])
                return path, *_read(self.fs, path)
            except Exception as exc:  # any damage: say so, set it aside for inspection, fall back
                aside = posixpath.join(self._path, "corrupt-" + name)
                warnings.warn(
                    f"{CORRUPT_WARNING}: {path} ({exc}); using the previous one, this one moved to {aside}",
                    stacklevel=2,
                )
                try:
                    self.fs.mv(path, aside, recursive=True)
                except OSError:
                    pass
        return None


def _read_file(fs: Any, folder: str, name: str) -> dict[str, Any]:
    with fs.open(posixpath.join(folder, name), "rb") as f:
        return torch.load(io.BytesIO(f.read()), weights_only=True)  # type: ignore[no-any-return]


def _drain(messages: queue.SimpleQueue[Any]) -> list[Any]:
    out = []
    while True:
        try:
            out.append(messages.get_nowait())
        except queue.Empty:
            return out


def _background_priority() -> None:
    """Run the writer thread at the lowest CPU priority: on a node shared with workers it must not slow their steps."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # Linux: per thread
    except (AttributeError, OSError):
        pass


@ray.remote(num_cpus=0)
def join_shards(*parts: Any) -> Any:
    """``shard_optimizer``: the whole state, as a checkpoint holds it, from every rank's ``state_dict`` (rank order).

    A task beside the workers (no CPU of theirs), so the driver and the checkpoint writer see one state, as
    from rank 0 unsharded."""
    return pytree.to_arrays(join_trees([pytree.from_arrays(p) for p in parts]))


def load_checkpoint(path: str) -> Any:
    """Load a checkpoint folder's state (a :class:`raympi.TrainState`), checksum verified.

    Args:
        path: a checkpoint folder (``.../step-00000040``, or the copy Ray Tune keeps of one) or a
            run's ``checkpoint_dir`` (then its newest valid checkpoint).

    Example:
        >>> state = raympi.load_checkpoint("runs/mnist/step-00000900")  # doctest: +SKIP
        >>> model.load_state_dict({**state.params, **state.buffers})  # doctest: +SKIP
    """
    fs, folder = fs_of(path)
    one = posixpath.basename(path.rstrip("/")).startswith("step-") or fs.exists(posixpath.join(folder, "manifest.json"))
    store = CheckpointStore(path) if not one else None
    if store is not None:
        found = store.latest()
        if found is None:
            raise FileNotFoundError(f"no valid checkpoint under {path}")
        return TrainState.from_dict(found[2])
    return TrainState.from_dict(_read(fs, folder)[1])
