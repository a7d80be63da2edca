"""Test-wide setup: Triton kernels run through the interpreter on machines without a GPU, and
engines run eagerly by default (``PREFIXSERVE_ENFORCE_EAGER``).

TRITON_INTERPRET is read when kernels are defined, so it must be set before any test imports
``prefixserve.kernels``; conftest.py runs first.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Engines run eagerly unless a test asks for compiled decode steps (``enforce_eager=False``, or
# the variable at 0 for a server): compiling each of the suite's short-lived engines would cost
# more than the suite runs. Servers the tests start inherit it.
os.environ.setdefault("PREFIXSERVE_ENFORCE_EAGER", "1")
# Test shapes are tiny: one thread is fastest and keeps timings steady on a shared machine.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_sessionstart(session):
    """Builds the C++ CPU kernels once, before any test starts a server that loads them: on a
    fresh machine the build takes minutes, longer than a server's start-up wait
    (``tests/servers.py``)."""
    if not torch.cuda.is_available():
        from prefixserve.kernels import cpu_ops

        cpu_ops.available()
