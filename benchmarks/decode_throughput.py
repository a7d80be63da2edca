"""Decode throughput of the engine on the built-in model: N concurrent sequences, tokens/s.

Workload: N requests (default 64) with distinct 32-token prompts, greedy, EOS ignored, 128 output
tokens each, all admitted at once. Measured: wall time of the decode-only steps (after every
prompt is prefilled) and generated tokens per second over them, median of --runs runs.
Machine: this one (CPU, float32, --threads torch threads). Baseline: none; the figure tracks the
engine's per-step cost at a full decode batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from prefixserve import LLM, SamplingParams


def measure(llm: LLM, num_seqs: int, max_tokens: int) -> float:
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"decode-{time.monotonic_ns()}-{i}", list(range(i, i + 32)), params)
    first = engine.stats().generation_tokens
    while engine.stats().num_waiting or engine.stats().generation_tokens - first < num_seqs:
        engine.step()  # until every sequence is decoding
    start_tokens = engine.stats().generation_tokens
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.perf_counter() - start
    return (engine.stats().generation_tokens - start_tokens) / elapsed


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    llm = LLM(num_kv_blocks=4096)
    measure(llm, min(args.num_seqs, 4), 4)  # warm-up
    rates = [measure(llm, args.num_seqs, args.max_tokens) for _ in range(args.runs)]
    result = {
        "model": llm.llm_engine.model_name,
        "num_seqs": args.num_seqs,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "decode_tokens_per_s": rates,
        "median_decode_tokens_per_s": statistics.median(rates),
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_throughput.json").write_text(json.dumps(result, indent=2))
    print(
        f"decode throughput, {args.num_seqs} concurrent sequences on {result['model']}: "
        f"{result['median_decode_tokens_per_s']:.0f} tokens/s (median of {args.runs}, "
        f"{args.threads} threads)"
    )
    return result


if __name__ == "__main__":
    main()
