"""Where one decode step's time goes, op by op (``torch.profiler``).

    python benchmarks/decode profile [--model smollm2] [--streams 1 8] [--steps 10]
        [--threads 2] [--enforce-eager] [--scheme float32]

Workload: N streams (``--streams``) with distinct 32-token prompts, greedy, EOS ignored, all
decoding; ``--steps`` decode steps run under ``torch.profiler``. Printed, in ms per step (self
time, so the rows add up to the profiled step, with the profiler's per-op overhead): the linear
kernels, attention, the compiled graph's own generated code (its Python wrapper and fused
kernels), MoE, the lm_head's share of the linear kernels (its calls counted apart), sampling,
and the rest; then the number of ops per step and the unprofiled step's min and median.
Machine: this one, CPU, ``--threads`` torch threads. Baseline: none; run it on two checkouts, or
with and without ``--enforce-eager``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from decode.common import SCHEMES, set_threads
from prefixserve import LLM, SamplingParams

# profiler event key -> row
CATEGORIES = {
    "prefixserve_cpu::linear_f32": "linear kernels",
    "prefixserve_cpu::linear_int8": "linear kernels",
    "prefixserve_cpu::linear_int4": "linear kernels",
    "prefixserve_cpu::linear_w8a8": "linear kernels",
    "prefixserve_cpu::linear_w4a8": "linear kernels",
    "prefixserve_cpu::linear_kq8": "linear kernels",
    "prefixserve_cpu::linear_kf32": "linear kernels",
    "prefixserve_cpu::paged_attention": "attention kernel",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention kernel",
    "prefixserve::grouped_moe": "MoE (Python op)",
    "prefixserve_cpu::rms_norm": "norms",
    "prefixserve_cpu::add_rms_norm": "norms",
    "aten::rms_norm": "norms",
}


def profile_streams(llm: LLM, streams: int, steps: int) -> dict:
    engine = llm.llm_engine
    vocab = engine.runner.model_config.vocab_size
    params = SamplingParams(max_tokens=2 * steps + 16, temperature=0.0, ignore_eos=True)
    for i in range(streams):
        prompt = [(300 + 40 * i + j) % vocab for j in range(32)]
        engine.add_request(f"profile-{time.monotonic_ns()}-{i}", prompt, params)
    for _ in range(4):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    rows: dict[str, float] = {}
    total, count = 0.0, 0
    for e in prof.key_averages():
        ms = e.self_cpu_time_total / 1e3 / steps
        total += ms
        count += e.count
        name = CATEGORIES.get(e.key)
        if name is None and e.key.startswith(("## Call CompiledFxGraph", "Torch-Compiled")):
            name = "compiled graph (wrapper, fused kernels)"
        rows[name or "other ops"] = rows.get(name or "other ops", 0.0) + ms
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    print(f"{streams} streams, {torch.get_num_threads()} threads, ms per profiled step "
          f"({total:.1f} in all, {count // steps} ops):")  # fmt: skip
    for name, ms in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"  {name:45s} {ms:8.2f}")
    print(f"  unprofiled step: min {1e3 * min(times):.1f} ms, "
          f"median {1e3 * statistics.median(times):.1f} ms")  # fmt: skip
    return {"ms_per_step": rows, "ops_per_step": count // steps,
            "unprofiled_ms": {"min": 1e3 * min(times), "median": 1e3 * statistics.median(times)}}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--scheme", default="float32", choices=list(SCHEMES))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    llm = LLM(args.model, num_kv_blocks=256, enforce_eager=args.enforce_eager,
              **SCHEMES[args.scheme])  # fmt: skip
    return {n: profile_streams(llm, n, args.steps) for n in args.streams}
