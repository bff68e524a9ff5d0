"""Light members: Ray actors in which ``import torch`` fails form a communicator and reduce numpy arrays."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from raympi import comm
from raympi.driver.config import MPIConfig

# Installed as the light actors' sitecustomize: torch cannot be imported from the interpreter's start.
BLOCK_TORCH = (
    "import sys\n"
    "class _NoTorch:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'torch' or name.startswith('torch.'):\n"
    "            raise ImportError('No module named torch (blocked: a light member)')\n"
    "sys.meta_path.insert(0, _NoTorch())\n"
)


def _light_class(ray, boot_dir):
    env = {**MPIConfig().environment(multi_host=False), "PYTHONPATH": str(boot_dir), "OMP_NUM_THREADS": "1"}

    @ray.remote(num_cpus=0, runtime_env={"env_vars": env})
    class Light(comm.Member):
        def torch_state(self):
            """(torch loaded, ``import torch`` failed)."""
            try:
                import torch  # noqa: F401

                failed = False
            except ImportError:
                failed = True
            return "torch" in sys.modules, failed

        def collectives(self, n):
            """A float32 and an int64 sum (several buckets each), a barrier and a broadcast of a plain dict."""
            r = self.comm.rank
            floats = self.comm.allreduce_array_(np.arange(n, dtype=np.float32) * (r + 1))
            ints = np.full((3, 5), r, dtype=np.int64)
            self.comm.allreduce_array_(ints)
            raw = bytearray([r + 1] * 8)  # any writable buffer
            self.comm.allreduce_array_(raw)
            self.comm.barrier()
            shared = self.comm.broadcast({"step": 7, "from": r} if r == 0 else None, root=0)
            return floats, ints, bytes(raw), shared, "torch" in sys.modules

    return Light


def test_light_members_form_and_reduce_without_torch(ray_session, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCK_TORCH)
    world, n = 3, 1000
    members = [_light_class(ray_session, tmp_path).remote() for _ in range(world)]
    try:
        assert ray_session.get([m.torch_state.remote() for m in members]) == [(False, True)] * world
        # small buckets: the 4000-byte float32 array goes as 16 buckets of 256 bytes
        ranks = comm.form(members, timeout_s=60, bucket_bytes=256)
        assert [r for r, _, _ in ranks] == list(range(world))
        out = ray_session.get([m.collectives.remote(n) for m in members])
        total = world * (world + 1) // 2
        for floats, ints, raw, shared, loaded in out:
            np.testing.assert_array_equal(floats, np.arange(n, dtype=np.float32) * total)
            np.testing.assert_array_equal(ints, np.full((3, 5), sum(range(world))))
            assert raw == bytes([total] * 8)
            assert shared == {"step": 7, "from": 0}
            assert not loaded, "a collective imported torch"
    finally:
        for m in members:
            ray_session.kill(m, no_restart=True)


def test_buffers_it_cannot_sum_in_place_are_refused():
    from raympi.comm.communicator import Communicator

    class _Stub(Communicator):
        def __init__(self):  # no MPI: the checks come first
            pass

    with pytest.raises(TypeError, match="writable"):
        _Stub().allreduce_array_(np.arange(8.0)[::2])
    with pytest.raises(TypeError, match="float16"):
        _Stub().allreduce_array_(np.zeros(4, dtype=np.float16))
    with pytest.raises(TypeError, match="bytes-like"):
        _Stub().allreduce_array_([1.0, 2.0])


def test_import_raympi_comm_without_torch():
    """``import raympi.comm`` (the package's __init__ included) in a process where torch cannot be imported."""
    code = (
        BLOCK_TORCH + "import raympi.comm\n"
        "from raympi.comm import Communicator, Member, form\n"
        "assert 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={**os.environ})
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-1500:]
