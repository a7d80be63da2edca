"""The KV-memory benchmark: what the paged cache holds and reads, in three modes.

    python benchmarks/kv_memory waste   [--num-requests 16] [--quick]
        internal fragmentation under ShareGPT-like lengths, against contiguous reservation
    python benchmarks/kv_memory sharing [--num-requests 16] [--beam-max-tokens 256] [--quick]
        KV blocks saved by copy-on-write forks for n > 1 and beam search
    python benchmarks/kv_memory reads   [--block-size 16] [--suffix 128] [--quick]
        K/V bytes one decode step reads, with and without cascade attention (analytic)

Each mode is its own module (``waste``, ``sharing``, ``reads``) with its workload, machine and
baseline in its docstring; they share ``benchmarks/workloads.py`` (length distributions, request
building, run options and ``write_report``). Results go to ``benchmarks/results/``.
"""

from __future__ import annotations

import importlib

MODES = ("waste", "sharing", "reads")


def main(argv: list[str]) -> object:
    """Run the mode ``argv[0]`` with the rest of ``argv``."""
    if not argv or argv[0] not in MODES:
        raise SystemExit(f"usage: python benchmarks/kv_memory {{{'|'.join(MODES)}}} [options]")
    return importlib.import_module(f"kv_memory.{argv[0]}").main(argv[1:])
