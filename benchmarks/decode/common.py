"""What the decode modes share: weight schemes, engine variants, the decode-rate measurement and
memory figures.

``decode_rate`` admits N streams at once (distinct 32-token prompts, greedy, EOS ignored), steps
until every stream decodes, then times the decode-only steps: generated tokens per second over
them, the fastest single step's rate, and the mean ms per step by phase (``EngineStats
.step_times``: schedule, prepare, forward, sample, output).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from prefixserve import LLM, SamplingParams

if TYPE_CHECKING:  # not imported: a baseline checkout (ab.py) may lay the engine out otherwise
    from prefixserve.engine.llm_engine import LLMEngine

# scheme -> LLM options on SmolLM2's shipped Q4_1 file
SCHEMES = {
    "float32": {"gguf_dequantize": True},
    "int8": {"gguf_dequantize": True, "quantization": "int8"},
    "int4": {"gguf_dequantize": True, "quantization": "int4"},
    "int4_sym": {"gguf_dequantize": True, "quantization": "int4_sym"},
    "gguf": {},  # the file's Q4_1 kept as int4, its Q8_0 vocabulary as int8
}
# variant -> LLM options
VARIANTS = {
    "compiled": {"enforce_eager": False},
    "eager": {"enforce_eager": True},
    "batch-invariant": {"enforce_eager": False, "batch_invariant": True},
    "float-activations": {"enforce_eager": False, "activation_quantization": None},
}
PHASES = ("schedule", "prepare", "forward", "sample", "output")


def start_streams(engine: LLMEngine, streams: int, max_tokens: int) -> None:
    """Admit ``streams`` requests at once (distinct 32-token prompts, greedy, EOS ignored, up to
    ``max_tokens`` tokens each) and step until every one of them decodes."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    vocab = engine.runner.model_config.vocab_size
    for i in range(streams):
        prompt = [(300 + 40 * i + j) % vocab for j in range(32)]
        engine.add_request(f"decode-{time.monotonic_ns()}-{i}", prompt, params)
    first = engine.stats().generation_tokens
    while engine.stats().num_waiting or engine.stats().generation_tokens - first < streams:
        engine.step()


def decode_rate(llm: LLM, streams: int, max_tokens: int) -> tuple[float, float, dict]:
    """(tokens/s over the decode steps, tokens/s of the fastest step, ms per step by phase)."""
    engine = llm.llm_engine
    start_streams(engine, streams, max_tokens)
    before = engine.stats()
    start_tokens, start = before.generation_tokens, time.perf_counter()
    best = float("inf")
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        engine.step()
        best = min(best, time.perf_counter() - step_start)
    elapsed = time.perf_counter() - start
    after = engine.stats()
    steps = after.num_steps - before.num_steps
    phases = {p: 1000 * (getattr(after.step_times, p) - getattr(before.step_times, p)) / steps
              for p in PHASES}  # fmt: skip
    return (after.generation_tokens - start_tokens) / elapsed, streams / best, phases


def weight_bytes(llm: LLM) -> int:
    """Bytes of every tensor the model holds (parameters and buffers: packed and quantized
    weights, norms, rope tables)."""
    model = llm.llm_engine.runner.model
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def rss_bytes() -> int:
    """This process's resident memory (``VmRSS``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def write(out_dir: str, name: str, result: dict) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(result, indent=2))


def set_threads(threads: int) -> None:
    torch.set_num_threads(threads)
