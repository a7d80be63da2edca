"""K/V bytes one decode step reads, with and without cascade attention (analytic; CPU, no kernels).

    python benchmarks/kv_memory reads [--quick] [--block-size 16] [--suffix 128]

Workload: N sequences (16, 64, 256) that share one S-token prefix (1k, 8k, 32k tokens) and each
hold a 128-token suffix of their own (the token being decoded included), all decoding one token.
The block tables are the engine's: each prompt goes through the KV cache manager (lookup, admit,
register full blocks), so the first computes the prefix and the others hit its physical blocks;
the step's metadata comes from the engine's one builder (``build_attention_metadata``), its
prefix groups from the attention layer's planner, and the groups that take cascade from the
Triton backend's own rule (``cascade_decode_groups``: ``cascade_pays`` per group).

Shape: Qwen3-0.6B's attention, 28 layers x 8 KV heads x head_dim 128 in bf16: K + V of one token
is 4 KiB a layer. Bytes per decode step, all layers:

    without cascade (baseline: the paged decode kernel alone): sum_i seq_len_i tokens
    with cascade: each cascade group's shared blocks once + each member's own suffix;
                  sequences in no cascade group read their whole context

so N (S + s) / (S + N s) is the ratio when every sequence joins one group; it is printed beside
the ratio the plan gives. Only K/V reads of the attention kernels are counted: weights, the
query and output vectors, and the cascade merge's float32 partials (per member, head and split:
a few KiB a layer) are not. The figures depend on the plan alone, not on any machine.

Writes benchmarks/results/kv_bytes.json (or under ``--out-dir``).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from workloads import RESULTS_DIR, write_report

from prefixserve.attention.metadata import SeqSpan, build_attention_metadata
from prefixserve.attention.triton_backend import cascade_decode_groups
from prefixserve.kv.hashing import extend_block_hashes
from prefixserve.kv.kv_cache_manager import KVCacheManager

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, DTYPE_BYTES = 28, 8, 128, 2  # Qwen3-0.6B, bf16
KV_BYTES_PER_TOKEN = 2 * NUM_KV_HEADS * HEAD_DIM * DTYPE_BYTES  # K and V, one layer
SEQS = (16, 64, 256)
SHARED = (1024, 8192, 32768)
QUICK_SEQS, QUICK_SHARED = (16, 64), (1024, 8192)


@dataclass(slots=True)
class StepBytes:
    num_seqs: int
    shared_tokens: int
    suffix_tokens: int
    cascade_groups: int  # groups of the plan that take cascade
    bytes_plain: int  # K/V bytes read per decode step, all layers, without cascade
    bytes_cascade: int  # the same with the plan's cascade groups
    ratio: float  # bytes_plain / bytes_cascade
    analytic_ratio: float  # N (S + s) / (S + N s)


def decode_step(num_seqs: int, shared: int, suffix: int, block_size: int) -> list[SeqSpan]:
    """The decode step's spans, block tables built by the KV cache manager: every prompt is the
    shared prefix plus ``suffix - 1`` tokens of its own, computed; the step decodes one more."""
    blocks_per_seq = -(-(shared + suffix) // block_size)
    kv = KVCacheManager(shared // block_size + num_seqs * blocks_per_seq + 1, block_size)
    prefix = list(range(shared))
    spans = []
    for i in range(num_seqs):
        own = shared + i * suffix
        prompt = prefix + list(range(own, own + suffix - 1))
        hashes: list[int] = []
        extend_block_hashes(prompt, block_size, (), hashes)
        hit = kv.lookup(prompt, hashes)
        assert kv.allocate_for_prompt(i, hit, len(prompt) - hit.num_tokens)
        kv.cache_full_blocks(i, prompt, hashes, len(prompt))
        assert kv.append_slots(i, len(prompt), 1) == []
        spans.append(SeqSpan(kv.get_block_table(i), len(prompt), 1))
    return spans


def step_bytes(
    num_seqs: int,
    shared: int,
    suffix: int,
    block_size: int = 16,
    cascade: bool | None = None,
    num_layers: int = NUM_LAYERS,
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN,
) -> StepBytes:
    """K/V bytes of one decode step of ``num_seqs`` sequences over a ``shared``-token prefix and
    ``suffix`` tokens each, from the step's plan (``cascade`` as ``TritonAttentionBackend``'s)."""
    spans = decode_step(num_seqs, shared, suffix, block_size)
    _, md = build_attention_metadata(spans, block_size, "cpu")
    groups = cascade_decode_groups(
        md.prefix_groups, md.num_decodes, md.seq_lens_cpu, block_size, kv_bytes_per_token, cascade
    )
    starts = [0] * md.num_seqs
    for members, num_blocks in groups:
        for i in members:
            starts[i] = num_blocks * block_size
    plain = sum(md.seq_lens_cpu)
    with_cascade = sum(n * block_size for _, n in groups)
    with_cascade += sum(n - s for n, s in zip(md.seq_lens_cpu, starts))
    per_token = num_layers * kv_bytes_per_token
    n, s, x = num_seqs, shared, suffix
    return StepBytes(
        num_seqs=n,
        shared_tokens=s,
        suffix_tokens=x,
        cascade_groups=len(groups),
        bytes_plain=plain * per_token,
        bytes_cascade=with_cascade * per_token,
        ratio=plain / with_cascade,
        analytic_ratio=n * (s + x) / (s + n * x),
    )


def format_table(rows: list[StepBytes]) -> str:
    lines = [
        f"{'seqs':>5} {'shared':>7} {'suffix':>6} {'groups':>6} {'plain GiB':>10} "
        f"{'cascade GiB':>11} {'ratio':>7} {'N(S+s)/(S+Ns)':>14}"
    ]
    for r in rows:
        lines.append(
            f"{r.num_seqs:>5} {r.shared_tokens:>7} {r.suffix_tokens:>6} {r.cascade_groups:>6} "
            f"{r.bytes_plain / 2**30:>10.2f} {r.bytes_cascade / 2**30:>11.3f} "
            f"{r.ratio:>7.2f} {r.analytic_ratio:>14.2f}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="K/V bytes per decode step with and without cascade attention, Qwen3-0.6B "
        "shape, from the engine's own block tables and attention plan."
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--suffix", type=int, default=128, help="own tokens per sequence")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_SEQS} sequences x {QUICK_SHARED} shared tokens only")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[StepBytes]:
    args = parse_args(argv)
    seqs, shared = (QUICK_SEQS, QUICK_SHARED) if args.quick else (SEQS, SHARED)
    start = time.perf_counter()
    rows = [step_bytes(n, s, args.suffix, args.block_size) for s in shared for n in seqs]
    elapsed = time.perf_counter() - start
    print(
        f"K/V bytes per decode step, {NUM_LAYERS} layers x {NUM_KV_HEADS} KV heads x {HEAD_DIM} "
        f"bf16 (Qwen3-0.6B), block_size {args.block_size}"
    )
    print(format_table(rows))
    report = {
        "workload": {
            "seqs": list(seqs),
            "shared_tokens": list(shared),
            "suffix_tokens": args.suffix,
            "block_size": args.block_size,
        },
        "shape": {
            "num_layers": NUM_LAYERS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "dtype_bytes": DTYPE_BYTES,
        },
        "rows": [asdict(r) for r in rows],
        "seconds": elapsed,
    }
    write_report(args.out_dir, "kv_bytes", report)
    best = max(rows, key=lambda r: r.ratio)
    print(
        f"cascade reads {best.ratio:.1f}x fewer K/V bytes at {best.num_seqs} sequences x "
        f"{best.shared_tokens} shared tokens; {min(r.ratio for r in rows):.1f}x at the least "
        f"[{elapsed:.1f} s]"
    )
    return rows


if __name__ == "__main__":
    main()
