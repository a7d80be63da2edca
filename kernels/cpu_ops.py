"""The CPU kernels written in C++ here (``cpu_linear.cpp``: linear layers on float activations;
``cpu_qlinear.cpp``: int8 / int4 linear layers on int8 activations; ``cpu_klinear.cpp``: GGUF's
block types on int8 or float activations, both on ``cpu_qisa.h``; ``cpu_attention.cpp``: paged
attention; ``cpu_norm.cpp``: RMSNorm and the residual add fused with it; ``cpu_sampling.cpp``: the
sampling step's finiteness check), registered as torch ops ``torch.ops.prefixserve_cpu.*``.

``available()`` builds them on first use with the machine's own compiler
(``torch.utils.cpp_extension``: ``-O3 -march=native -ffp-contract=off``, OpenMP through the
libgomp torch already loaded), caches the build on disk in a folder named by a hash of the sources,
the flags and torch's version (under ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``: checkouts with the same sources share one build, different ones
never rebuild each other's; a second process waits on the first's lock, then loads: see
``load_extension``) and
registers the ops' output shapes for ``torch.compile``. It returns False, logged once, where the
build fails (no compiler, no ninja, another architecture's compiler): callers then keep torch's
own kernels. ``-ffp-contract=off``: every fused multiply-add is written out in the sources, so
each output's operation sequence is the one written (the kernels' batch invariance rests on it).
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import time
from pathlib import Path

import torch
import xxhash

logger = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent
_SOURCES = [_HERE / "cpu_linear.cpp", _HERE / "cpu_qlinear.cpp", _HERE / "cpu_klinear.cpp",
            _HERE / "cpu_attention.cpp", _HERE / "cpu_norm.cpp",
            _HERE / "cpu_sampling.cpp"]  # fmt: skip
# part of the build's digest, not compiled alone
HEADERS = [_HERE / "cpu_qisa.h", _HERE / "cpu_rows.h"]
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]


@functools.cache
def available() -> bool:
    """Whether the ``prefixserve_cpu`` ops can run here (built and loaded in this process)."""
    start = time.perf_counter()
    digest = xxhash.xxh3_64(f"{torch.__version__}|{_FLAGS}".encode())
    for source in _SOURCES + HEADERS:
        digest.update(source.read_bytes())
    try:
        load_extension(f"prefixserve_cpu_{digest.hexdigest()}", _SOURCES, _FLAGS)
    except Exception as e:  # any build failure: torch's kernels serve instead
        logger.warning("CPU kernels unavailable (%s); using torch's", e)
        return False
    _register_fakes()
    logger.info("CPU kernels ready in %.1f s", time.perf_counter() - start)
    return True


def load_extension(name: str, sources: list[Path], flags: list[str]) -> None:
    """Builds (or finds built) and loads ops library ``name`` from ``sources`` in
    ``<extensions dir>/<name>``, holding an ``flock`` on ``<name>.flock`` beside it.

    Invariant: at most one process is inside torch's build of a folder, and a process killed
    there never blocks the next. Torch serialises builds with a plain file (``lock`` in the
    folder) that it waits on while it exists; a process killed while holding it (a server
    stopped during start-up) would leave every later start waiting forever. The kernel releases
    an ``flock`` when its holder dies, so under it any ``lock`` file is a dead process's: it is
    removed before torch looks.
    """
    from torch.utils import cpp_extension

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released by close, or by the kernel at death
        (folder / "lock").unlink(missing_ok=True)
        cpp_extension.load(
            name=name,
            sources=[str(s) for s in sources],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            is_python_module=False,
            verbose=False,
        )


def _register_fakes() -> None:
    """Output shapes for ``torch.compile`` (the ops are opaque calls in a compiled graph)."""
    lib = "prefixserve_cpu::"

    @torch.library.register_fake(lib + "linear_f32")
    def _(x, w, bias, n):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake(lib + "linear_int8")
    def _(x, w, scales, group, bias, n):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake(lib + "linear_int4")
    def _(x, w, scales, shifts, group, bias, n):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake(lib + "linear_w8a8")
    def _(x, w, scales, bias, n):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake(lib + "linear_w4a8")
    def _(x, w, scales, shifts, bias, n):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake(lib + "linear_kq8")
    def _(x, low, high, scales, sub, shifts, mins, bits, offset, span, bias, n):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake(lib + "linear_kf32")
    def _(x, low, high, scales, sub, shifts, mins, bits, offset, span, bias, n):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake(lib + "paged_attention")
    def _(q, k, v, kv_cache, slot_mapping, block_tables, token_seq, token_len, scale):
        return torch.empty_like(q)

    @torch.library.register_fake(lib + "rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake(lib + "add_rms_norm")
    def _(x, residual, weight, eps):
        return torch.empty_like(x), torch.empty_like(x)
