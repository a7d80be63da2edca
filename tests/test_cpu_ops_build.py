"""``cpu_ops.load_extension``: one process at a time inside torch's build of a folder, and a
process killed there never blocks the next (torch's own ``lock`` file would, forever)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from torch.utils import cpp_extension

from prefixserve.kernels import cpu_ops

# A child that enters load_extension with a build that never ends, says so, and waits to be killed.
_STUCK_CHILD = """
import sys, time
from torch.utils import cpp_extension
from prefixserve.kernels import cpu_ops
def stuck(**kwargs):
    open(kwargs["build_directory"] + "/lock", "w").close()  # what torch's baton leaves
    print("building", flush=True)
    time.sleep(600)
cpp_extension.load = stuck
cpu_ops.load_extension("ops_x", [], [])
"""


@pytest.fixture
def fake_load(monkeypatch, tmp_path):
    """Builds into ``tmp_path``; records each call and whether torch's lock file was there."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    calls = []

    def load(**kwargs):
        folder = kwargs["build_directory"]
        calls.append((kwargs["name"], folder, (tmp_path / "ops_x" / "lock").exists()))

    monkeypatch.setattr(cpp_extension, "load", load)
    return calls


def test_a_dead_builders_lock_file_is_removed_before_torch_looks(fake_load, tmp_path):
    (tmp_path / "ops_x").mkdir()
    (tmp_path / "ops_x" / "lock").touch()
    cpu_ops.load_extension("ops_x", [], ["-O3"])
    assert fake_load == [("ops_x", str(tmp_path / "ops_x"), False)]


def test_a_builder_killed_mid_build_does_not_block_the_next(fake_load, tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    child = subprocess.Popen(
        [sys.executable, "-c", _STUCK_CHILD], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert child.stdout.readline().strip() == "building"
        # While the child builds, this process waits for it.
        waited = threading.Thread(
            target=cpu_ops.load_extension, args=("ops_x", [], []), daemon=True
        )
        waited.start()
        time.sleep(0.5)
        assert not fake_load and waited.is_alive()
        child.kill()
        child.wait()
        waited.join(timeout=30)
        assert not waited.is_alive()
        assert fake_load == [("ops_x", str(tmp_path / "ops_x"), False)]
    finally:
        child.kill()
        child.wait()
