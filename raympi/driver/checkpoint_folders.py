"""Atomic checkpoint folders on a local or fsspec file system: written, renamed, pruned, cleaned up.

:class:`AtomicFolders` is the storage half of :class:`~raympi.driver.checkpoint.CheckpointStore`.
A checkpoint ``step-N`` is written as a hidden ``.step-N.tmp-PID`` (its files fsynced), then renamed
into place; an older one is renamed aside (``.step-N.old-PID``) before it is deleted.  So a kill at any
moment leaves no ``step-*`` folder that loads wrong, only hidden leftovers that the next write removes
once their process is gone.  A temporary folder that rank 0 writes into (``.step-N.tmp-PID-SEQ``,
named by the driver) is committed the same way.

Which folders a write leaves is :func:`kept`'s rule: the newest ``keep``, or with a metric (``checkpoint_metric``)
the ``keep`` best by it, and the newest always, since that is the one a resume continues from.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import posixpath
import re
import shutil
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from raympi.worker.checkpoint_io import fsync_dir as _fsync_dir, is_local as _is_local

__all__ = ["AtomicFolders", "IN_FLIGHT", "kept", "ranked", "remove_folder", "score"]

_LEFTOVER = re.compile(r"\.step-\d+\.(?:tmp|old)-(\d+)(?:-\d+)?|\.write-test-(\d+)")  # what a write leaves if killed
#: The checkpoint folders this process is writing or deleting, in any store, which are never taken for leftovers.
IN_FLIGHT: set[str] = set()


class AtomicFolders:
    """Checkpoint folders under ``self._path`` of ``self.fs`` (set by the subclass), ``self.keep`` of them kept by
    :func:`kept`: the newest, or with ``self.metric`` the best by it (``self.mode``) and the newest."""

    root: str
    keep: int
    metric: str | None
    mode: Literal["min", "max"]
    fs: Any
    _path: str
    _scores: dict[str, float | None]  # each folder's value of ``metric``, read once (the writes put theirs here)

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
        self._scores[name] = score(manifest.get("metrics"), self.metric) if self.metric else None
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
        """Keep what :func:`kept` chooses; each other one is renamed aside first, so a kill never leaves half of one."""
        try:
            names = self._names()
            keep = kept(names, self._scores_of(names), self.keep, self.mode)
            for name in names:
                if name not in keep:
                    aside = posixpath.join(self._path, f".{name}.old-{os.getpid()}")
                    self._rename(posixpath.join(self._path, name), aside)
                    self._scores.pop(name, None)
                    remove_folder(self.fs, aside)
        except OSError:
            pass  # the checkpoint is written; the next write prunes again

    def _scores_of(self, names: Sequence[str]) -> dict[str, float | None]:
        """Each folder's value of ``metric`` (all None without one); a folder this process did not write is read
        once, and one whose manifest cannot be read has no value."""
        if self.metric is None:
            return {}
        for name in names:
            if name not in self._scores:
                self._scores[name] = score(self._manifest(name).get("metrics"), self.metric)
        return {name: self._scores[name] for name in names}

    def _manifest(self, name: str) -> dict[str, Any]:
        """The manifest of folder ``name``, or ``{}`` where it is missing or unreadable."""
        try:
            with self.fs.open(posixpath.join(self._path, name, "manifest.json"), "rb") as f:
                manifest = json.loads(f.read())
        except (OSError, ValueError):
            return {}
        return manifest if isinstance(manifest, dict) else {}


def score(metrics: Any, metric: str) -> float | None:
    """``metrics[metric]`` as a float: ``None`` where the record lacks it (a step without evaluation) or it is not a
    finite number (NaN, infinite, a string), so such a checkpoint is never taken for the best.

    Example:
        >>> record = {"step": 40, "loss": 0.5, "eval_loss": float("nan")}
        >>> score(record, "loss"), score(record, "eval_loss"), score(record, "eval_accuracy")
        (0.5, None, None)
    """
    value = metrics.get(metric) if isinstance(metrics, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def ranked(names: Sequence[str], scores: Mapping[str, float | None], mode: Literal["min", "max"] = "min") -> list[str]:
    """The checkpoint folders ``names`` (oldest first, as their zero-padded steps sort), best first: those with a
    score by it (``mode="min"``: lowest first), then those without, each group newest first; of equal scores the
    newer comes first.  Without any score (``scores`` empty): newest first.

    Example:
        >>> ranked(["s1", "s2", "s3", "s4"], {"s1": 0.4, "s2": 0.3, "s3": None, "s4": 0.3})
        ['s4', 's2', 's1', 's3']
    """
    sign = 1.0 if mode == "min" else -1.0

    def order(age_name: tuple[int, str]) -> tuple[bool, float, int]:
        age, name = age_name
        value = scores.get(name)
        return (value is None, 0.0 if value is None else sign * value, age)

    return [name for _, name in sorted(enumerate(reversed(names)), key=order)]


def kept(
    names: Sequence[str], scores: Mapping[str, float | None], keep: int, mode: Literal["min", "max"] = "min"
) -> set[str]:
    """The folders a prune leaves of ``names`` (oldest first): the first ``keep`` of :func:`ranked`, and the newest
    always (a resume continues from it), so ``keep + 1`` at most.  A folder without a score is kept only as the
    newest or while fewer than ``keep`` have one; without any score this is the newest ``keep``.

    Example:
        >>> sorted(kept(["s1", "s2", "s3", "s4"], {"s1": 0.2, "s2": 0.1, "s3": 0.5}, keep=2))
        ['s1', 's2', 's4']
    """
    return set(ranked(names, scores, mode)[:keep]) | set(names[-1:])


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
