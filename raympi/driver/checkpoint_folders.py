"""Atomic checkpoint folders on a local or fsspec file system: written, renamed, pruned, cleaned up.

:class:`AtomicFolders` is the storage half of :class:`~raympi.driver.checkpoint.CheckpointStore`.
A checkpoint ``step-N`` is written as a hidden ``.step-N.tmp-PID`` (its files fsynced), then renamed
into place; an older one is renamed aside (``.step-N.old-PID``) before it is deleted.  So a kill at any
moment leaves no ``step-*`` folder that loads wrong, only hidden leftovers that the next write removes
once their process is gone.  A temporary folder that rank 0 writes into (``.step-N.tmp-PID-SEQ``,
named by the driver) is committed the same way.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import posixpath
import re
import shutil
from typing import Any

from raympi.worker.checkpoint_io import fsync_dir as _fsync_dir, is_local as _is_local

__all__ = ["AtomicFolders", "IN_FLIGHT", "remove_folder"]

_LEFTOVER = re.compile(r"\.step-\d+\.(?:tmp|old)-(\d+)(?:-\d+)?|\.write-test-(\d+)")  # what a write leaves if killed
#: The checkpoint folders this process is writing or deleting, in any store, which are never taken for leftovers.
IN_FLIGHT: set[str] = set()


class AtomicFolders:
    """Checkpoint folders under ``self._path`` of ``self.fs`` (set by the subclass), newest ``self.keep`` kept."""

    root: str
    keep: int
    fs: Any
    _path: str

    def _commit(self, manifest: dict[str, Any], blob: Any = None, tmp: str | None = None) -> str:
        """Write ``state.pt`` (``blob``; or it is in ``tmp`` already, written by rank 0) and the manifest
        into a temporary folder, then rename it into place and prune; returns the folder."""
        meta = json.dumps(manifest, indent=1, default=repr).encode()
        name = f"step-{int(manifest['step']):08d}"
        final = posixpath.join(self._path, name)
        own, old = (posixpath.join(self._path, f".{name}.{kind}-{os.getpid()}") for kind in ("tmp", "old"))
        tmp = tmp or own
        replaced = False
        try:
            self._remove_leftovers()
            IN_FLIGHT.update((tmp, old))
            if blob is not None:
                self._write(posixpath.join(tmp, "state.pt"), blob)
            self._write(posixpath.join(tmp, "manifest.json"), meta)
            replaced = self.fs.exists(final)
            if replaced:  # the same step again: set the old one aside first, a rename is atomic
                self._rename(final, old)
            self._rename(tmp, final)
        except OSError as exc:
            remove_folder(self.fs, tmp)
            with contextlib.suppress(OSError):
                if replaced and not self.fs.exists(final):
                    self._rename(old, final)  # the previous copy of this step stays
            raise OSError(exc.errno, self._why_lost(name, exc, manifest["bytes"] + len(meta))) from exc
        finally:
            IN_FLIGHT.difference_update((tmp, old))
        if replaced:
            remove_folder(self.fs, old)
        self._prune()
        return self._url(name)

    def _url(self, name: str) -> str:
        return posixpath.join(self._path, name) if _is_local(self.root) else f"{self.root.rstrip('/')}/{name}"

    def _why_lost(self, name: str, exc: OSError, needed: int) -> str:
        """A failed write's message: the folder, on a full disk the space, and the checkpoint a restart uses."""
        full = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded"}.get(exc.errno or 0)
        free = f"{shutil.disk_usage(self._path).free / 1e6:.1f} MB free, " if full and _is_local(self.root) else ""
        why = (
            f"{full} on {self._path} ({free}{needed / 1e6:.1f} MB needed)"
            if full
            else f"{exc.strerror or exc} on {self._path}"
        )
        return f"checkpoint {name} not written: {why}; {self._still()}"

    def _still(self) -> str:
        try:
            names = self._names()
        except OSError:
            names = []
        return f"the newest checkpoint is still {names[-1]}" if names else "there is no checkpoint yet"

    def _rename(self, src: str, dst: str) -> None:
        if _is_local(self.root):
            os.rename(src, dst)
            return _fsync_dir(self._path)
        self.fs.mv(src, dst, recursive=True)

    def _remove_leftovers(self) -> None:
        """Remove what writes killed midway left (their process is gone), or this process's failed ones."""
        for name in self._names(prefix="."):
            path = posixpath.join(self._path, name)
            if (match := _LEFTOVER.fullmatch(name)) and path not in IN_FLIGHT and not _alive(int(match[1] or match[2])):
                remove_folder(self.fs, path)

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
                remove_folder(self.fs, aside)
        except OSError:
            pass  # the checkpoint is written; the next write prunes again


def _alive(pid: int) -> bool:
    """Whether another process ``pid`` runs on this host (this one's folders not in flight are failed writes)."""
    try:
        if pid == os.getpid():
            return False
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: another user's process
        return True


def remove_folder(fs: Any, path: str) -> None:
    """Remove a folder and what it holds; one already gone (or that cannot be removed now) is left alone."""
    with contextlib.suppress(OSError):  # absent, or a leftover the next write removes
        fs.rm(path, recursive=True)
