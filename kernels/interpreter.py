"""Which Triton ran the kernels: the GPU compiler, or the interpreter that runs them on CPU tensors.

Triton picks the interpreter when a kernel is defined (``TRITON_INTERPRET=1`` in the environment
before the first kernel module of ``prefixserve.kernels`` is imported), so the choice is fixed
for the life of the process.
"""

from __future__ import annotations


def interpreter_enabled() -> bool:
    """True when the kernels were defined under Triton's interpreter (runnable on CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction

    from prefixserve.kernels.kv_store import _store_kv_kernel

    return isinstance(_store_kv_kernel, InterpretedFunction)
