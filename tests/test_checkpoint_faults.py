"""Checkpoint writes under faults: a kill at any point, a full disk, a read-only disk. No Ray actors.

The kill test forks a writer and SIGKILLs it at every file-system operation of a write in turn
(before and after each mkdir, write half, fsync, rename, unlink, rmdir), then checks in the parent
that the newest checkpoint loads right. The disk tests mount small tmpfs folders (root only).
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import re
import shutil
import signal
import subprocess
import traceback
import warnings

import pytest
import torch

import raympi
from raympi.comm import library
from raympi.driver.checkpoint import CheckpointStore
from raympi.driver.checkpoint_folders import IN_FLIGHT
from raympi.worker.checkpoint_io import write_state
from raympi.exceptions import ConfigError


def _state(step: int, mb: float = 2.0) -> dict:
    """A state of about ``mb`` megabytes whose values depend on ``step``."""
    rows = int(mb * 1e6 / 4 / 1024)
    generator = torch.Generator().manual_seed(step)
    return {
        "params": {"w": torch.randn(rows, 1024, generator=generator), "b": torch.full((7,), float(step))},
        "step": torch.tensor(step),
    }


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_leaves(a), _leaves(b), strict=True))


def _leaves(tree: dict) -> list[torch.Tensor]:
    return [
        leaf for key in sorted(tree) for leaf in (_leaves(tree[key]) if isinstance(tree[key], dict) else [tree[key]])
    ]


def _arm(point: int) -> None:
    """In a forked writer: SIGKILL this process at the ``point``-th file-system operation boundary."""
    count = [0]

    def tick() -> None:
        count[0] += 1
        if count[0] == point:
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap(fn):
        def wrapped(*args, **kwargs):
            tick()
            out = fn(*args, **kwargs)
            tick()
            return out

        return wrapped

    for module, name in [
        (os, "fsync"),
        (os, "rename"),
        (os, "replace"),
        (os, "mkdir"),
        (os, "unlink"),
        (os, "remove"),
        (os, "rmdir"),
        (shutil, "rmtree"),
    ]:
        setattr(module, name, wrap(getattr(module, name)))

    class Torn:
        """A file written in two halves, a kill point between them (a torn write)."""

        def __init__(self, f) -> None:
            self._f = f

        def write(self, data) -> int:
            view = memoryview(data).cast("B")
            self._f.write(view[: len(view) // 2])
            self._f.flush()
            tick()
            self._f.write(view[len(view) // 2 :])
            return len(view)

        def __getattr__(self, name):
            return getattr(self._f, name)

    real_open = builtins.open
    builtins.open = lambda file, mode="r", *a, **kw: (Torn if "w" in mode else (lambda f: f))(
        real_open(file, mode, *a, **kw)
    )


def _fork_writer(root: str, keep: int, state: dict, step: int, point: int, direct: bool = False) -> bool:
    """Write ``step`` in a forked process killed at ``point``; True if it was killed, False if it finished.

    ``direct``: as rank 0 and the driver write a large state (the driver makes the temporary folder,
    rank 0 streams ``state.pt`` into it, the driver adds the manifest and renames), in one process.
    """
    store = CheckpointStore(root, keep=keep)
    pid = os.fork()
    if pid == 0:  # the writer: never returns into pytest
        code = 1
        try:
            _arm(point)
            if direct:
                tmp = os.path.join(root, f".step-{step:08d}.tmp-{os.getpid()}-1")
                IN_FLIGHT.add(tmp)
                os.mkdir(tmp)
                sha, size = write_state(store.fs, os.path.join(tmp, "state.pt"), state, local=True)
                store._commit({"step": step, "sha256": sha, "bytes": size}, tmp=tmp)
            else:
                store.save(state, {"step": step})
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True
    assert os.WEXITSTATUS(status) == 0, "the writer failed (not killed): see its traceback above"
    return False


@pytest.mark.parametrize(
    "case",
    [
        "new step, pruned to keep=1",
        "same step again, keep=2",
        "direct: new step, keep=1",
        "direct: same step again, keep=2",
    ],
)
def test_a_kill_at_any_point_of_a_write_never_leaves_a_newest_checkpoint_that_loads_wrong(tmp_path, case):
    direct = case.startswith("direct: ")
    keep, again = (1, False) if case.removeprefix("direct: ").startswith("new") else (2, True)
    states = {10: _state(10), 20: _state(20), 21: _state(21)}  # 21: the new content of step 20 written again
    outcomes, complete_leftovers = set(), 0
    for point in range(1, 300):
        root = str(tmp_path / f"kill-{point}")
        CheckpointStore(root, keep=keep).save(states[10], {"step": 10, "version": 10})
        if again:
            CheckpointStore(root, keep=keep).save(states[20], {"step": 20, "version": 20})
        killed = _fork_writer(root, keep, states[21 if again else 20], 20, point, direct)
        version = 21 if again else 20
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a damaged step-* folder would be reported: none may be
            path, manifest, state = CheckpointStore(root, keep=keep).latest()
        found = manifest.get("version", version)
        assert found in ({10, 20, 21} if killed else {version}), (point, path)
        assert _same(state, states[found]), f"kill point {point}: {path} loads another state than was saved"
        outcomes.add(found)
        leftovers = [n for n in os.listdir(root) if not n.startswith("step-")]
        assert all(re.fullmatch(r"\.step-000000[12]0\.(tmp|old)-\d+(-1)?", n) for n in leftovers), leftovers
        complete_leftovers += any(os.path.exists(os.path.join(root, n, "manifest.json")) for n in leftovers)
        CheckpointStore(root, keep=keep).save(_state(30, mb=0.1), {"step": 30})  # a later write cleans up
        assert [n for n in os.listdir(root) if not n.startswith("step-")] == []
        assert CheckpointStore(root).latest()[1]["step"] == 30 and len(os.listdir(root)) == keep
        shutil.rmtree(root)
        if not killed:
            break
    assert not killed, "the write never finished: more kill points than the sweep covers"
    assert point > 15, f"only {point} kill points: the hooks do not see the write"
    assert outcomes >= ({20, 21} if again else {10, 20}), f"kills ended on {outcomes} only"
    assert complete_leftovers, "no kill left a whole temporary folder: the test misses the moment before the rename"


@contextlib.contextmanager
def _tmpfs(folder, options: str):
    """A tmpfs mounted on ``folder`` for the block (skips the test where mounting is not allowed)."""
    folder.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({options}) here: {done.stderr.strip()}")
    try:
        yield str(folder)
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MB disk."""
    with _tmpfs(tmp_path / "disk", "size=8m") as folder:
        yield folder


def _fill(folder: str, leave: int) -> str:
    """Fill ``folder`` up to ``leave`` free bytes (tmpfs counts whole pages)."""
    filler = os.path.join(folder, "filler")
    with open(filler, "wb") as f:
        f.write(b"\0" * (shutil.disk_usage(folder).free - leave))
    return filler


@pytest.mark.parametrize("fails_at", ["state.pt", "manifest.json"])
def test_a_full_disk_costs_one_checkpoint_with_a_warning_and_training_goes_on(small_disk, fails_at):
    store = CheckpointStore(small_disk, keep=2)
    store.save_async(_state(10), {"step": 10})
    store.wait()
    written = store._write
    failed = []

    def recording(path, data):
        try:
            written(path, data)
        except OSError:
            failed.append(os.path.basename(path))
            raise

    store._write = recording
    filler = None
    if fails_at == "manifest.json":  # state.pt fits to the page, its manifest does not
        buffer = io.BytesIO()
        torch.save(_state(20), buffer)
        filler = _fill(small_disk, -(-len(buffer.getvalue()) // 4096) * 4096)
    store.save_async(_state(20, mb=10 if fails_at == "state.pt" else 2), {"step": 20})
    pattern = (
        rf"checkpoint step-00000020 not written: no space left on {re.escape(small_disk)} "
        r"\((\d+\.\d) MB free, (\d+\.\d) MB needed\); the newest checkpoint is still step-00000010; training goes on"
    )
    with pytest.warns(UserWarning, match=pattern) as record:
        store.wait(strict=True)  # what the controller calls at a planned stop and at the end: no raise
    free, needed = map(float, re.search(pattern, str(record[0].message)).groups())
    assert failed == [fails_at] and (free < needed if fails_at == "state.pt" else free <= needed)  # 0.1 MB rounding
    assert [step for _, step, _ in store.drain_saved()] == [10]  # the driver's newest stays step 10
    assert sorted(set(os.listdir(small_disk)) - {"filler"}) == ["step-00000010"]  # no partial folder
    path, manifest, state = store.latest()
    assert manifest["step"] == 10 and _same(state, _state(10))
    if filler:
        os.remove(filler)
    for step in (30, 40):  # space again: the writes succeed and prune as usual
        store.save_async(_state(step), {"step": step})
    store.close()
    assert sorted(os.listdir(small_disk)) == ["step-00000030", "step-00000040"]
    assert _same(store.latest()[2], _state(40))


def test_other_storage_errors_warn_too_but_a_bad_state_still_raises(small_disk):
    store = CheckpointStore(small_disk, keep=3)
    store.save(_state(10, mb=0.1), {"step": 10})
    subprocess.run(["mount", "-o", "remount,ro", small_disk], check=True)
    try:
        store.save_async(_state(20, mb=0.1), {"step": 20})
        with pytest.warns(
            UserWarning,
            match=rf"step-00000020 not written: Read-only file system on {re.escape(small_disk)}; "
            "the newest checkpoint is still step-00000010; training goes on",
        ):
            store.wait(strict=True)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", small_disk], check=True)
    store.save_async({"f": lambda: 0}, {"step": 30})  # the state itself cannot be written: not a storage error
    with pytest.raises(Exception, match="pickle"):
        store.wait(strict=True)
    store.save_async(_state(40, mb=0.1), {"step": 40})
    store.close()
    assert sorted(os.listdir(small_disk)) == ["step-00000010", "step-00000040"]


def test_a_read_only_checkpoint_dir_is_a_config_error(tmp_path):
    with _tmpfs(tmp_path / "ro", "ro,size=1m") as folder:
        with pytest.raises(ConfigError, match=r"checkpoint_dir=.*/ro' is not writable \(Read-only file system\)"):
            CheckpointStore(folder)
        with pytest.raises(ConfigError, match="not writable"):
            CheckpointStore(os.path.join(folder, "run"))


def test_fit_with_an_unwritable_checkpoint_dir_fails_before_any_actor_starts(tmp_path):
    if library.problem():
        pytest.skip(library.problem())
    import ray

    if ray.is_initialized():
        pytest.skip("Ray is already running in this session")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    data = (torch.randn(16, 3), torch.randint(0, 2, (16,)))
    with pytest.raises(ConfigError, match="not writable"):
        raympi.fit(
            torch.nn.Linear(3, 2),
            data,
            workers=2,
            epochs=1,
            batch_size=8,
            checkpoint_dir=str(blocker / "ck"),
            progress=False,
        )
    assert not ray.is_initialized()
