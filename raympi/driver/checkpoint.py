"""Checkpoints: rank 0's state, written by the driver, never half-written.

A checkpoint is a folder ``step-00000040/`` holding ``state.pt`` (a plain dict of
tensors, loadable with ``torch.load(weights_only=True)``) and ``manifest.json``
(step, epoch, data cursor, world size, metrics, config and the SHA-256 of
``state.pt``).  It is written under a temporary name, flushed, fsynced and then
renamed, so a reader sees a whole checkpoint or none.  ``checkpoint_dir`` may be
a local path or an fsspec URI (``s3://...``, ``gs://...``, ``memory://...``).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import json
import os
import posixpath
import queue
import threading
import warnings
from typing import Any

import torch

from raympi.exceptions import ConfigError, WorkerLostError

__all__ = ["CheckpointStore", "load_checkpoint", "CORRUPT_WARNING"]

CORRUPT_WARNING = "raympi checkpoint unusable"


def _is_local(root: str) -> bool:
    return "://" not in root or root.startswith("file://")


class CheckpointStore:
    """The checkpoints of one run under ``root``, of which the newest ``keep`` are kept.

    Raises:
        ConfigError: ``root`` cannot be created or written (checked at once, before any worker starts).
    """

    def __init__(self, root: str, keep: int = 3, fetch_timeout_s: float = 60.0) -> None:
        import fsspec

        self.root = root.removeprefix("file://")
        self.keep = keep
        self.fetch_timeout_s = fetch_timeout_s  # rank 0 handing over its state (a stopped rank must not hang us)
        self.fs = fsspec.filesystem("file") if _is_local(root) else fsspec.core.url_to_fs(root)[0]
        self._path = self.root if _is_local(root) else self.fs._strip_protocol(root)
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raympi-checkpoint", initializer=_background_priority)
        self._pending: list[concurrent.futures.Future] = []
        self._saved: queue.SimpleQueue = queue.SimpleQueue()
        try:
            self.fs.makedirs(self._path, exist_ok=True)
            probe = posixpath.join(self._path, f".write-test-{os.getpid()}")
            with self.fs.open(probe, "wb") as f:
                f.write(b"ok")
            self.fs.rm(probe)
        except OSError as exc:
            raise ConfigError(f"checkpoint_dir={root!r} is not writable ({exc.strerror or exc}): choose another checkpoint_dir") from None

    def file(self, name: str) -> str:
        """Path of a file next to the checkpoints (metrics, plot)."""
        return posixpath.join(self._path, name)

    def save_async(self, state: Any, manifest: dict[str, Any]) -> concurrent.futures.Future:
        """Write in the background; ``state`` may be a Ray object ref (fetched by the writer).

        Once the checkpoint is on disk, ``(path, step, state)`` is queued for :meth:`drain_saved`.
        """
        future = self._writer.submit(self._save_ref, state, manifest)
        self._pending.append(future)
        return future

    def drain_saved(self) -> list[tuple[str, int, dict[str, Any]]]:
        """The checkpoints written since the last call, oldest first: ``(path, step, state)``."""
        out = []
        while True:
            try:
                out.append(self._saved.get_nowait())
            except queue.Empty:
                return out

    def _save_ref(self, state: Any, manifest: dict[str, Any]) -> str:
        if not isinstance(state, dict):
            import ray

            from raympi.core import pytree

            try:
                state = pytree.from_arrays(ray.get(state, timeout=self.fetch_timeout_s))  # zero-copy views
            except ray.exceptions.GetTimeoutError:
                raise WorkerLostError(f"rank 0 did not hand over its state for step {manifest['step']} within "
                                      f"{self.fetch_timeout_s:g} s (startup_timeout_s)") from None
        path = self.save(state, manifest)
        self._saved.put((path, int(manifest["step"]), state))  # handed to the driver's thread, never shared
        return path

    def wait(self, strict: bool = True) -> None:
        """Block until every background write is done; re-raise a failed one (``strict``) or warn about it."""
        pending, self._pending = self._pending, []
        for future in pending:
            error = future.exception()
            if error is not None and strict:
                raise error
            if error is not None:
                warnings.warn(f"a checkpoint was lost with its worker ({type(error).__name__}); the previous one is used", stacklevel=2)

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
        manifest = {**manifest, "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
        name = f"step-{int(manifest['step']):08d}"
        final = posixpath.join(self._path, name)
        tmp = posixpath.join(self._path, f".{name}.tmp-{os.getpid()}")
        if self.fs.exists(tmp):
            self.fs.rm(tmp, recursive=True)
        self.fs.makedirs(tmp, exist_ok=True)
        self._write(posixpath.join(tmp, "state.pt"), blob)
        self._write(posixpath.join(tmp, "manifest.json"), json.dumps(manifest, indent=1, default=repr).encode())
        if self.fs.exists(final):
            self.fs.rm(final, recursive=True)
        if _is_local(self.root):
            _fsync_dir(tmp)
            os.rename(tmp, final)
            _fsync_dir(self._path)
        else:
            self.fs.mv(tmp, final, recursive=True)
        self._prune()
        return final if _is_local(self.root) else f"{self.root.rstrip('/')}/{name}"

    def _write(self, path: str, data: bytes) -> None:
        with self.fs.open(path, "wb") as f:
            f.write(data)
            if _is_local(self.root):
                f.flush()
                os.fsync(f.fileno())

    def _names(self) -> list[str]:
        entries = self.fs.ls(self._path, detail=False) if self.fs.exists(self._path) else []
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries if posixpath.basename(e.rstrip("/")).startswith("step-"))

    def _prune(self) -> None:
        for name in self._names()[: -self.keep]:
            self.fs.rm(posixpath.join(self._path, name), recursive=True)

    def latest(self) -> tuple[str, dict[str, Any], dict[str, Any]] | None:
        """``(path, manifest, state)`` of the newest valid checkpoint; broken ones are reported and skipped."""
        for name in reversed(self._names()):
            path = posixpath.join(self._path, name)
            try:
                return path, *_read(self.fs, path)
            except Exception as exc:  # any damage: say so, set it aside for inspection, fall back
                aside = posixpath.join(self._path, "corrupt-" + name)
                warnings.warn(f"{CORRUPT_WARNING}: {path} ({exc}); using the previous one, this one moved to {aside}", stacklevel=2)
                try:
                    self.fs.mv(path, aside, recursive=True)
                except OSError:
                    pass
        return None


def _read(fs: Any, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    with fs.open(posixpath.join(path, "manifest.json"), "rb") as f:
        manifest = json.loads(f.read())
    with fs.open(posixpath.join(path, "state.pt"), "rb") as f:
        blob = f.read()
    if hashlib.sha256(blob).hexdigest() != manifest.get("sha256"):
        raise ValueError(f"checksum mismatch ({len(blob)} bytes, manifest says {manifest.get('bytes')})")
    return manifest, torch.load(io.BytesIO(blob), weights_only=True)


def _background_priority() -> None:
    """Run the writer thread at the lowest CPU priority: on a node shared with workers it must not slow their steps."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # Linux: per thread
    except (AttributeError, OSError):
        pass


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path: str) -> Any:
    """Load a checkpoint folder's state (a :class:`raympi.TrainState`), checksum verified.

    Args:
        path: a checkpoint folder (``.../step-00000040``) or a run's ``checkpoint_dir``
            (then its newest valid checkpoint).

    Example:
        >>> state = raympi.load_checkpoint("runs/mnist/step-00000900")  # doctest: +SKIP
        >>> model.load_state_dict({**state.params, **state.buffers})  # doctest: +SKIP
    """
    from raympi.core.state import TrainState

    store = CheckpointStore(path) if not posixpath.basename(path.rstrip("/")).startswith("step-") else None
    if store is not None:
        found = store.latest()
        if found is None:
            raise FileNotFoundError(f"no valid checkpoint under {path}")
        return TrainState.from_dict(found[2])
    import fsspec

    fs = fsspec.filesystem("file") if _is_local(path) else fsspec.core.url_to_fs(path)[0]
    return TrainState.from_dict(_read(fs, path.removeprefix("file://") if _is_local(path) else fs._strip_protocol(path))[1])
