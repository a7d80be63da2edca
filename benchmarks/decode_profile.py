"""Where one decode step's time goes on a real model, piece by piece (torch.profiler).

    python benchmarks/decode_profile.py [--model smollm2] [--streams 1 8] [--steps 10]
        [--threads 1]

Workload: N streams (``--streams``) with distinct 32-token prompts, greedy, EOS ignored, all
decoding (float32, the GGUF dequantized). ``--steps`` decode steps run under ``torch.profiler``
with a ``record_function`` label around each piece: the model forward, per layer the attention
block, the attention backend call and its K/V write, the MLP, the norms and rope, then the
``lm_head``, sampling, scheduling and output processing. Printed: ms per step of each piece
(inclusive of the pieces inside it, with the profiler's own per-op overhead, so the sum runs
above the unprofiled step), the time in the matmul and attention kernels, the number of
aten ops per step, and the unprofiled step's min and median. Machine: this one, CPU, ``--threads``
torch threads. Baseline: none; run it on two checkouts to compare.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from prefixserve import LLM, SamplingParams
from prefixserve.attention import torch_backend
from prefixserve.models import llama

PIECES = [
    (llama.LlamaForCausalLM, "forward", "model forward"),
    (llama.Attention, "forward", "  attention block (qkv, rope, attention, o_proj)"),
    (torch_backend.TorchAttentionBackend, "forward", "    attention backend (K/V write + attn)"),
    (llama.MLP, "forward", "  MLP"),
    (llama.RMSNorm, "forward", "  RMSNorm"),
    (llama.RotaryEmbedding, "forward", "  RotaryEmbedding.forward"),
    (llama, "apply_rope", "  apply_rope"),  # absent before the rope was split in two
    (llama.LlamaForCausalLM, "compute_logits", "lm_head"),
]
KERNELS = [
    "aten::mm",  # F.linear and the transposed MLP
    "mkldnn::_linear_pointwise",  # prepacked multi-row matmuls
    "aten::_scaled_dot_product_flash_attention_for_cpu",
]


def label(cls: object, method: str, name: str, undo: list) -> None:
    """Wrap ``cls.method`` (a class or module attribute) in a ``record_function(name)``; what
    to restore goes on ``undo``."""
    f = getattr(cls, method, None)
    if f is None:
        return

    @functools.wraps(f)
    def wrapped(*args, **kwargs):
        with record_function(name):
            return f(*args, **kwargs)

    undo.append((cls, method, cls.__dict__[method]))
    setattr(cls, method, wrapped)


def profile_streams(llm: LLM, streams: int, steps: int) -> None:
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
    events = {e.key: e for e in prof.key_averages()}
    num_ops = sum(e.count for e in events.values() if e.key.startswith("aten::"))
    print(f"{streams} streams, {torch.get_num_threads()} threads, ms per step (profiled):")
    for name in [n for _, _, n in PIECES] + ["sample", "schedule + update", "output"]:
        if name in events:
            e = events[name]
            print(f"  {name:50s} {e.cpu_time_total / 1e3 / steps:8.2f}   ({e.count // steps}/step)")
    for name in [k for k in KERNELS if k in events]:
        e = events[name]
        print(f"  {name:50s} {e.cpu_time_total / 1e3 / steps:8.2f}   ({e.count // steps}/step)")
    print(f"  aten ops per step: {num_ops // steps}")
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    print(f"  unprofiled step: min {1e3 * min(times):.1f} ms, "
          f"median {1e3 * statistics.median(times):.1f} ms")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, gguf_dequantize=True, num_kv_blocks=512)
    engine = llm.llm_engine
    pieces = PIECES + [
        (type(engine.sampling_step), "sample", "sample"),
        (type(engine.scheduler), "schedule", "schedule + update"),
        (type(engine.scheduler), "update_from_output", "schedule + update"),
        (type(engine.output_processor), "make_output", "output"),
    ]
    undo: list = []
    try:
        for cls, method, name in pieces:
            label(cls, method, name, undo)
        for n in args.streams:
            profile_streams(llm, n, args.steps)
    finally:
        for cls, method, original in reversed(undo):
            setattr(cls, method, original)


if __name__ == "__main__":
    main()
