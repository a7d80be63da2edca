"""Offline decode tokens/s of each weight scheme on SmolLM2-135M-Instruct (or any GGUF / named model).

Workload: N streams (``--streams``, default 1 and 8) with distinct 32-token prompts, greedy, EOS
ignored, ``--max-tokens`` tokens each, admitted at once. Measured: generated tokens per second
over the decode-only steps (after every prompt is prefilled), median of ``--runs`` runs (the
schemes take turns), and the rate of the fastest single step (robust on a shared machine).
Schemes: ``float32`` (the file dequantized), ``int8`` / ``int4`` (``--quantization``), ``gguf``
(the file's types kept). Machine: this one, CPU, ``--threads`` torch threads. Baseline: llama.cpp
is not run here (see issue 22); the figures compare the schemes with each other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from prefixserve import LLM, SamplingParams

SCHEMES = {
    "float32": {"gguf_dequantize": True},
    "int8": {"gguf_dequantize": True, "quantization": "int8"},
    "int4": {"gguf_dequantize": True, "quantization": "int4"},
    "gguf": {},
}


def decode_rate(llm: LLM, streams: int, max_tokens: int) -> tuple[float, float]:
    """(tokens/s over the decode steps, tokens/s of the fastest single step)."""
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    vocab = engine.runner.model_config.vocab_size
    for i in range(streams):
        prompt = [(300 + 40 * i + j) % vocab for j in range(32)]
        engine.add_request(f"decode-{time.monotonic_ns()}-{i}", prompt, params)
    first = engine.stats().generation_tokens
    while engine.stats().num_waiting or engine.stats().generation_tokens - first < streams:
        engine.step()  # until every stream is decoding
    start_tokens, start = engine.stats().generation_tokens, time.perf_counter()
    best = float("inf")
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        engine.step()
        best = min(best, time.perf_counter() - step_start)
    elapsed = time.perf_counter() - start
    return (engine.stats().generation_tokens - start_tokens) / elapsed, streams / best


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    llms = {s: LLM(args.model, num_kv_blocks=512, **SCHEMES[s]) for s in args.schemes}
    for llm in llms.values():
        decode_rate(llm, 1, 4)  # warm-up
    runs = {s: {n: [] for n in args.streams} for s in args.schemes}
    for _ in range(args.runs):  # schemes in turn, so a busy minute hits all of them
        for s, llm in llms.items():
            for n in args.streams:
                runs[s][n].append(decode_rate(llm, n, args.max_tokens))
    rates = {s: {n: [r for r, _ in v] for n, v in d.items()} for s, d in runs.items()}
    median = {s: {n: statistics.median(v) for n, v in d.items()} for s, d in rates.items()}
    best = {s: {n: max(b for _, b in v) for n, v in d.items()} for s, d in runs.items()}
    for s in args.schemes:
        for n in args.streams:
            print(f"{s:8s} {n:3d} streams: {median[s][n]:7.1f} tokens/s (median), "
                  f"fastest step {best[s][n]:7.1f} tokens/s")  # fmt: skip
    result = {
        "model": args.model,
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "decode_tokens_per_s": rates,
        "median": median,
        "fastest_step_tokens_per_s": best,
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
