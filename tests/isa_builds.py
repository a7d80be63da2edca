"""Builds of the integer kernels (``cpu_qlinear.cpp``, ``cpu_klinear.cpp`` on ``cpu_qisa.h``) for
other instruction sets (-march), each in its own op namespace beside the engine's build, so a
test compares every instruction set's bits with the native build's and the torch reference's."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
import xxhash

from prefixserve.kernels import cpu_ops

# (march, namespace, the path it must take)
ISA_BUILDS = [("x86-64-v3", "qlinear_avx2", "avx2"), ("x86-64", "qlinear_portable", "portable")]
_KERNELS = Path(cpu_ops.__file__).resolve().parent
SOURCES = [_KERNELS / "cpu_qlinear.cpp", _KERNELS / "cpu_klinear.cpp"]


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.fixture(scope="module", params=ISA_BUILDS, ids=[b[2] for b in ISA_BUILDS])
def isa_ops(request):
    """The ops of one build (built once per source version, cached like the engine's)."""
    march, namespace, isa = request.param
    if platform.machine() != "x86_64" or (isa == "avx2" and "avx2" not in _cpu_flags()):
        pytest.skip(f"{march} does not run here")
    flags = ["-O2", f"-march={march}", "-ffp-contract=off", "-fopenmp",
             f"-DQLINEAR_NAMESPACE={namespace}"]  # fmt: skip
    digest = xxhash.xxh3_64(f"{torch.__version__}|{flags}".encode())
    for source in SOURCES + cpu_ops.HEADERS:
        digest.update(source.read_bytes())
    cpu_ops.load_extension(f"{namespace}_{digest.hexdigest()}", SOURCES, flags)
    ops = getattr(torch.ops, namespace)
    assert ops.qlinear_isa() == isa
    return ops
