"""Checkpoint files as the driver and rank 0 both write and read them (layer 3; no Ray).

A checkpoint folder holds ``state.pt`` (``torch.save`` of a state tree of plain CPU tensors, read
with ``weights_only=True``) and ``manifest.json`` (with the SHA-256 and size of ``state.pt``).  With
``shard_optimizer`` it holds one file per rank instead, ``shard-00000.pt`` ... (rank 0's with the
parameters), each rank's written by that rank in parallel; the manifest lists them (``shards``: file,
SHA-256, size) and loading joins them into the whole state, which a new group of any size cuts anew.  The
driver writes small states itself (:mod:`raympi.driver.checkpoint`).  A large one rank 0 writes
straight to storage with a :class:`DirectWriter`: it copies its state (the only time training
waits), and a background thread streams the copy into the temporary folder the driver made,
hashing as it goes; the driver then adds the manifest and renames the folder into place, so a
kill of either process at any moment never leaves a ``step-*`` folder that loads wrong.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import posixpath
import threading
import time
from typing import Any

import torch

from raympi.core import pytree
from raympi.exceptions import ConfigError

__all__ = [
    "DirectWriter",
    "Snapshot",
    "StoredState",
    "fs_of",
    "fsync_dir",
    "is_local",
    "read_checkpoint",
    "shard_file",
    "verify",
    "write_state",
]

_CHUNK = 8 * 2**20


def is_local(url: str) -> bool:
    """Whether ``url`` is a local path (or ``file://``)."""
    return "://" not in url or url.startswith("file://")


def fs_of(url: str) -> tuple[Any, str]:
    """The fsspec file system of ``url`` and the path within it."""
    import fsspec

    if is_local(url):
        return fsspec.filesystem("file"), url.removeprefix("file://")
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path


def fsync_dir(path: str) -> None:
    """Make a local folder's entries (a new file, a rename) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Hashing:
    """A write-only file that hashes and counts what passes through it (``torch.save`` streams into it)."""

    def __init__(self, f: Any) -> None:
        self.f, self.sha, self.count = f, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        self.sha.update(data)
        self.f.write(data)
        self.count += memoryview(data).nbytes
        return memoryview(data).nbytes

    def flush(self) -> None:
        self.f.flush()


def write_state(fs: Any, path: str, tree: dict[str, Any], local: bool, progress: Any = None) -> tuple[str, int]:
    """Stream ``torch.save(tree)`` into ``path`` (fsynced when local); returns its SHA-256 and size.

    ``progress``, when given, holds the hashing writer (under ``"out"``): its ``count`` grows as bytes go out.
    """
    with fs.open(path, "wb") as f:
        out = _Hashing(f)
        if progress is not None:
            progress["out"] = out
        torch.save(tree, out)  # type: ignore[arg-type]  # (a file-like object: write() is all torch.save uses)
        if local:
            f.flush()
            os.fsync(f.fileno())
    if local:
        fsync_dir(posixpath.dirname(path))
    return out.sha.hexdigest(), out.count


def shard_file(rank: int) -> str:
    """The file rank ``rank`` writes into a checkpoint of a sharded state."""
    return f"shard-{rank:05d}.pt"


def shards_digest(shards: list[dict[str, Any]]) -> str:
    """The checksum a manifest records for a sharded checkpoint: of its files' checksums, in rank order."""
    return hashlib.sha256("".join(s["sha256"] for s in shards).encode()).hexdigest()


def _files(manifest: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """``(file, sha256, bytes)`` of each state file the manifest lists."""
    shards = manifest.get("shards")
    if shards is None:
        return [("state.pt", manifest.get("sha256", ""), manifest.get("bytes"))]
    return [(s["file"], s["sha256"], s["bytes"]) for s in shards]


def verify(fs: Any, folder: str) -> dict[str, Any]:
    """The manifest of checkpoint ``folder`` once its state files match their checksums (read in chunks, never whole).

    Raises:
        ValueError: a checksum differs (a torn or damaged file).
    """
    with fs.open(posixpath.join(folder, "manifest.json"), "rb") as f:
        manifest: dict[str, Any] = json.loads(f.read())
    for name, expected, nbytes in _files(manifest):
        sha, size = hashlib.sha256(), 0
        with fs.open(posixpath.join(folder, name), "rb") as f:
            while chunk := f.read(_CHUNK):
                sha.update(chunk)
                size += len(chunk)
        if sha.hexdigest() != expected:
            raise ValueError(f"checksum mismatch in {name} ({size} bytes, manifest says {nbytes})")
    return manifest


def read_checkpoint(fs: Any, folder: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(manifest, state)`` of checkpoint ``folder``, checksum verified (a sharded state joined whole).

    Raises:
        ValueError: a checksum differs.
    """
    with fs.open(posixpath.join(folder, "manifest.json"), "rb") as f:
        manifest = json.loads(f.read())
    trees = []
    for name, expected, nbytes in _files(manifest):
        with fs.open(posixpath.join(folder, name), "rb") as f:
            blob = f.read()
        if hashlib.sha256(blob).hexdigest() != expected:
            raise ValueError(f"checksum mismatch in {name} ({len(blob)} bytes, manifest says {nbytes})")
        trees.append(torch.load(io.BytesIO(blob), weights_only=True))
    return manifest, join_trees(trees)


def join_trees(trees: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole state (as ``TrainState.to_dict``) from a checkpoint's state files: ``state.pt``'s tree, or
    every rank's sharded one in rank order."""
    if len(trees) == 1:
        return trees[0]
    from raympi.core.shard import join_states
    from raympi.core.state import TrainState

    states = [TrainState.from_dict(t) for t in trees]
    return join_states(states).to_dict()


@dataclasses.dataclass(frozen=True)
class StoredState:
    """A checkpoint's state left on storage: the driver hands this to the workers, which read it themselves.

    Attributes:
        url: the checkpoint folder (a local path on storage every node shares, or an fsspec URL).
        sha256: the checksum its manifest records for ``state.pt``.
        bytes: the size of ``state.pt``.
    """

    url: str
    sha256: str
    bytes: int

    def load(self) -> dict[str, Any]:
        """The state tree, checksum verified (a local file is hashed in chunks, then memory-mapped).

        Raises:
            ConfigError: the folder is not there (a local ``checkpoint_dir`` that this node does not share).
            ValueError: the checksum differs.
        """
        fs, folder = fs_of(self.url)
        try:
            if not is_local(self.url):
                return read_checkpoint(fs, folder)[1]
            manifest = verify(fs, folder)
            if manifest.get("sha256") != self.sha256:
                raise ValueError(f"{self.url} was replaced by another checkpoint of the same step")
            return join_trees(
                [torch.load(posixpath.join(folder, f), weights_only=True, mmap=True) for f, _, _ in _files(manifest)]
            )
        except FileNotFoundError:
            import socket

            raise ConfigError(
                f"the checkpoint {self.url} cannot be read on {socket.gethostname()}: a local "
                "checkpoint_dir must be storage every node mounts (NFS), or use an fsspec URL"
            ) from None


@dataclasses.dataclass
class Snapshot:
    """What rank 0 answers to a checkpoint request.

    Attributes:
        arrays: the state (as :func:`raympi.core.pytree.to_arrays`) for the driver to write, or ``None``
            when rank 0 writes it into ``folder`` itself.
        folder: the temporary folder being written in the background, else ``None``.
        bytes: the state's tensor bytes.
        copy_s: seconds taken by the copy of the state.
        blocked_s: seconds training waited (a previous write still running, plus the copy).
        note: why the driver writes a large state after all (rank 0 cannot see ``folder``).
    """

    arrays: dict[str, Any] | None = None
    folder: str | None = None
    bytes: int = 0
    copy_s: float = 0.0
    blocked_s: float = 0.0
    note: str | None = None


def state_bytes(tree: Any) -> int:
    """Bytes of the tensors in ``tree``."""
    return sum(t.numel() * t.element_size() for t in pytree.leaves(tree) if isinstance(t, torch.Tensor))


def _fits(buffer: Any, t: Any) -> bool:
    if not isinstance(t, torch.Tensor):
        return not isinstance(buffer, torch.Tensor)
    return isinstance(buffer, torch.Tensor) and buffer.shape == t.shape and buffer.dtype == t.dtype


def _protocols(fs: Any) -> set[str]:
    return {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)


class DirectWriter:
    """Rank 0's background writer of large checkpoints; at most one write (and one copy) at a time."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._status: dict[str, dict[str, Any]] = {}
        self._buffers: list[Any] = []  # the copy's tensors, reused: a fresh 1 GB costs its page faults each time

    def start(self, tree: dict[str, Any], folder: str | None, min_bytes: int, name: str = "state.pt") -> Snapshot:
        """Copy ``tree`` and write it into ``folder``'s file ``name`` in the background, if it has at least
        ``min_bytes``; otherwise (or when this process cannot see ``folder``) a :class:`Snapshot` without
        ``folder``: the caller sends the state to the driver."""
        size = state_bytes(tree)
        if folder is None or size < min_bytes:
            return Snapshot(bytes=size)
        fs, path = fs_of(folder)
        if _protocols(fs) & {"file", "memory"}:  # where folders exist (not in object stores)
            if not fs.isdir(path):  # made by the driver: not here, so not shared with it
                import socket

                return Snapshot(bytes=size, note=f"rank 0 on {socket.gethostname()} cannot see {folder}")
        start = time.perf_counter()
        if self._thread is not None:
            self._thread.join()  # one copy at a time: memory stays at one state more
        copied = time.perf_counter()
        copy = self._copy(tree)
        done = time.perf_counter()
        status: dict[str, Any] = {"done": False, "error": None, "written": 0, "started": time.time()}
        self._status = dict(list(self._status.items())[-15:]) | {folder: status}  # the driver may ask about older ones
        self._thread = threading.Thread(
            target=self._write,
            args=(copy, fs, posixpath.join(path, name), status),
            daemon=True,
            name="raympi-direct-checkpoint",
        )
        self._thread.start()
        return Snapshot(folder=folder, bytes=size, copy_s=done - copied, blocked_s=done - start)

    def wait(self) -> None:
        """Until the write in flight, if any, is done."""
        if self._thread is not None:
            self._thread.join()

    def _copy(self, tree: dict[str, Any]) -> dict[str, Any]:
        """``tree`` on the CPU, copied into the buffers of the previous copy where they fit (its write is done)."""
        leaves, spec = pytree.flatten(tree)
        old = self._buffers
        if len(old) != len(leaves) or any(not _fits(b, t) for b, t in zip(old, leaves)):
            old = [t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor) else t for t in leaves]
        else:
            old = [b.copy_(t) if isinstance(t, torch.Tensor) else t for b, t in zip(old, leaves)]
        self._buffers = old
        copied: dict[str, Any] = pytree.unflatten(old, spec)
        return copied

    def _write(self, tree: dict[str, Any], fs: Any, file: str, status: dict[str, Any]) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # never slow the steps down
        except (AttributeError, OSError):
            pass
        progress: dict[str, Any] = {}
        status["progress"] = progress
        try:
            local = "file" in _protocols(fs)
            sha, size = write_state(fs, file, tree, local, progress)
            status.update(sha256=sha, bytes=size, write_s=time.time() - status["started"])
        except Exception as exc:  # reported to the driver, which warns and keeps the previous checkpoint
            status["error"] = exc.strerror or str(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
            status.update(storage=isinstance(exc, OSError), errno=getattr(exc, "errno", None))
        finally:
            del tree
            status["done"] = True

    def status(self, folder: str) -> dict[str, Any]:
        """How the write into ``folder`` goes: ``done``, ``error``, ``written`` bytes, and once done
        ``sha256``, ``bytes``, ``write_s``."""
        status = self._status.get(folder)
        if status is None:
            return {"done": True, "error": "no such write on this rank (it restarted?)", "written": 0}
        out = status.get("progress", {}).get("out")
        return {k: v for k, v in status.items() if k != "progress"} | {"written": out.count if out else 0}
