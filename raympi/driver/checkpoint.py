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
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import hashlib
import io
import json
import os
import posixpath
import queue
import re
import shutil
import threading
import warnings
from typing import Any

import torch

from raympi.exceptions import ConfigError, WorkerLostError

__all__ = ["CheckpointStore", "load_checkpoint", "CORRUPT_WARNING"]

CORRUPT_WARNING = "raympi checkpoint unusable"
_LEFTOVER = re.compile(r"\.step-\d+\.(?:tmp|old)-(\d+)|\.write-test-(\d+)")  # what a write leaves if killed
_IN_FLIGHT: set[str] = set()  # this process's folders being written or deleted (any store)


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
        self._lost: queue.SimpleQueue = queue.SimpleQueue()  # why a write failed, warned on the driver's thread
        try:
            self.fs.makedirs(self._path, exist_ok=True)
            probe = posixpath.join(self._path, f".write-test-{os.getpid()}")
            _IN_FLIGHT.add(probe)  # not a leftover
            with self.fs.open(probe, "wb") as f:
                f.write(b"ok")
            self.fs.rm(probe)
            _IN_FLIGHT.discard(probe)
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
        """The checkpoints written since the last call, oldest first: ``(path, step, state)``; warns of lost ones."""
        self._warn_lost()
        return _drain(self._saved)

    def _save_ref(self, state: Any, manifest: dict[str, Any]) -> str | None:
        if not isinstance(state, dict):
            import ray

            from raympi.core import pytree

            try:
                state = pytree.from_arrays(ray.get(state, timeout=self.fetch_timeout_s))  # zero-copy views
            except ray.exceptions.GetTimeoutError:
                raise WorkerLostError(f"rank 0 did not hand over its state for step {manifest['step']} within "
                                      f"{self.fetch_timeout_s:g} s (startup_timeout_s)") from None
        try:
            path = self.save(state, manifest)
        except OSError as exc:  # storage, not the state: warn, keep training on the previous checkpoint
            self._lost.put(f"{exc.strerror or exc}; training goes on")
            return None
        self._saved.put((path, int(manifest["step"]), state))  # handed to the driver's thread, never shared
        return path

    def wait(self, strict: bool = True) -> None:
        """Block until every background write is done; re-raise a failed one (``strict``) or warn about it."""
        pending, self._pending = self._pending, []
        for future in pending:
            error = future.exception()
            self._warn_lost()
            if error is not None and strict:
                raise error
            if error is not None:
                warnings.warn(f"a checkpoint was lost with its worker ({type(error).__name__}); the previous one is used", stacklevel=2)

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
        manifest = {**manifest, "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
        meta = json.dumps(manifest, indent=1, default=repr).encode()
        name = f"step-{int(manifest['step']):08d}"
        final = posixpath.join(self._path, name)
        tmp, old = (posixpath.join(self._path, f".{name}.{kind}-{os.getpid()}") for kind in ("tmp", "old"))
        replaced = False
        try:
            self._remove_leftovers()
            _IN_FLIGHT.update((tmp, old))
            self._write(posixpath.join(tmp, "state.pt"), blob)
            self._write(posixpath.join(tmp, "manifest.json"), meta)
            replaced = self.fs.exists(final)
            if replaced:  # the same step again: set the old one aside first, a rename is atomic
                self._rename(final, old)
            self._rename(tmp, final)
        except OSError as exc:
            _remove(self.fs, tmp)
            with contextlib.suppress(OSError):
                if replaced and not self.fs.exists(final):
                    self._rename(old, final)  # the previous copy of this step stays
            raise OSError(exc.errno, self._why_lost(name, exc, len(blob) + len(meta))) from exc
        finally:
            _IN_FLIGHT.difference_update((tmp, old))
        if replaced:
            _remove(self.fs, old)
        self._prune()
        return final if _is_local(self.root) else f"{self.root.rstrip('/')}/{name}"

    def _why_lost(self, name: str, exc: OSError, needed: int) -> str:
        """A failed write's message: the folder, on a full disk the space, and the checkpoint a restart uses."""
        full = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded"}.get(exc.errno)
        free = f"{shutil.disk_usage(self._path).free / 1e6:.1f} MB free, " if full and _is_local(self.root) else ""
        why = f"{full} on {self._path} ({free}{needed / 1e6:.1f} MB needed)" if full else f"{exc.strerror or exc} on {self._path}"
        try:
            names = self._names()
        except OSError:
            names = []
        still = f"the newest checkpoint is still {names[-1]}" if names else "there is no checkpoint yet"
        return f"checkpoint {name} not written: {why}; {still}"

    def _rename(self, src: str, dst: str) -> None:
        if _is_local(self.root):
            os.rename(src, dst)
            return _fsync_dir(self._path)
        self.fs.mv(src, dst, recursive=True)

    def _remove_leftovers(self) -> None:
        """Remove what writes killed midway left (their process is gone), or this process's failed ones."""
        for name in self._names(prefix="."):
            path = posixpath.join(self._path, name)
            if (match := _LEFTOVER.fullmatch(name)) and path not in _IN_FLIGHT and not _alive(int(match[1] or match[2])):
                _remove(self.fs, path)

    def _write(self, path: str, data: bytes) -> None:
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        with self.fs.open(path, "wb") as f:
            f.write(data)
            if _is_local(self.root):
                f.flush()
                os.fsync(f.fileno())
                _fsync_dir(posixpath.dirname(path))

    def _names(self, prefix: str = "step-") -> list[str]:
        entries = self.fs.ls(self._path, detail=False) if self.fs.exists(self._path) else []
        return sorted(name for e in entries if (name := posixpath.basename(e.rstrip("/"))).startswith(prefix))

    def _prune(self) -> None:
        """Keep the newest ``keep``; each older one is renamed aside first, so a kill never leaves half of one."""
        try:
            for name in self._names()[: -self.keep]:
                aside = posixpath.join(self._path, f".{name}.old-{os.getpid()}")
                self._rename(posixpath.join(self._path, name), aside)
                _remove(self.fs, aside)
        except OSError:
            pass  # the checkpoint is written; the next write prunes again

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


def _drain(messages: queue.SimpleQueue) -> list[Any]:
    out = []
    while True:
        try:
            out.append(messages.get_nowait())
        except queue.Empty:
            return out


def _alive(pid: int) -> bool:
    """Whether another process ``pid`` runs on this host (this one's folders not in flight are failed writes)."""
    try:
        return pid != os.getpid() and os.kill(pid, 0) is None
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: another user's process
        return True


def _remove(fs: Any, path: str) -> None:
    with contextlib.suppress(OSError):  # absent, or a leftover the next write removes
        fs.rm(path, recursive=True)


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
