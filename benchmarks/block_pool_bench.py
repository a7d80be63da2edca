"""Micro-benchmarks of the KV cache core (plain Python, CPU only).

    python benchmarks/block_pool_bench.py [--runs 7] [--block-size 16]

Each figure is the median of ``--runs`` runs timed with ``time.perf_counter_ns``. Results
are printed as a table and written to benchmarks/results/block_pool_bench.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from prefixserve.kv.hashing import extend_block_hashes
from prefixserve.kv.kv_cache_manager import KVCacheManager

RESULTS = Path(__file__).parent / "results" / "block_pool_bench.json"


def median_ns(fn: Callable[[int], None], runs: int) -> float:
    """Median wall time of ``fn(run_index)`` over ``runs`` runs."""
    samples = []
    for run in range(runs):
        start = time.perf_counter_ns()
        fn(run)
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples)


def prompt_cycle(mgr: KVCacheManager, tokens: list[int], hashes: list[int]) -> None:
    """What one prompt costs the cache: lookup, allocate, register its blocks, free."""
    hit = mgr.lookup(tokens, hashes)
    assert mgr.allocate_for_prompt("s", hit, len(tokens) - hit.num_tokens)
    mgr.cache_full_blocks("s", tokens, hashes, len(tokens))
    mgr.free("s")


def bench_prompt(block_size: int, runs: int, prompt_len: int, hit: bool) -> dict[str, float]:
    """A 2,048-token prompt whose full prefix is cached, or one never seen (a fresh one per run).

    The pool holds 4 prompts, so misses evict the blocks of earlier ones.
    """
    prompts = []
    for run in range(1 if hit else runs + 1):
        tokens = list(range(run * prompt_len, (run + 1) * prompt_len))
        hashes: list[int] = []
        extend_block_hashes(tokens, block_size, (), hashes)
        prompts.append((tokens, hashes))
    mgr = KVCacheManager(4 * prompt_len // block_size, block_size)
    prompt_cycle(mgr, *prompts[0])
    if hit:
        assert mgr.lookup(*prompts[0]).num_tokens == prompt_len - block_size
    ns = median_ns(lambda run: prompt_cycle(mgr, *prompts[0 if hit else run + 1]), runs)
    return {"prompt_tokens": prompt_len, "median_us": ns / 1e3}


def bench_shared_prefix(block_size: int, runs: int, num_seqs: int, prefix: int, tail: int) -> dict:
    seqs = []
    for i in range(num_seqs):
        tokens = list(range(prefix)) + list(range(10**6 * (i + 1), 10**6 * (i + 1) + tail))
        hashes: list[int] = []
        extend_block_hashes(tokens, block_size, (), hashes)
        seqs.append((tokens, hashes))
    num_blocks = (prefix + num_seqs * (tail + block_size)) // block_size + 1
    mgr = KVCacheManager(num_blocks, block_size, watermark=0.0)

    def run(_: int) -> None:
        for i, (tokens, hashes) in enumerate(seqs):
            hit = mgr.lookup(tokens, hashes)
            assert mgr.allocate_for_prompt(i, hit, len(tokens) - hit.num_tokens)
            mgr.cache_full_blocks(i, tokens, hashes, len(tokens))
        for i in range(num_seqs):
            mgr.free(i)

    ns = median_ns(run, runs)
    return {
        "num_seqs": num_seqs,
        "prefix_tokens": prefix,
        "tail_tokens": tail,
        "median_ms": ns / 1e6,
        "per_seq_us": ns / 1e3 / num_seqs,
    }


def bench_hashing(block_size: int, runs: int, num_tokens: int) -> dict[str, float]:
    tokens = list(range(num_tokens))
    ns = median_ns(lambda _: extend_block_hashes(tokens, block_size, ("salt", None), []), runs)
    return {"tokens": num_tokens, "tokens_per_s": num_tokens / (ns / 1e9)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="runs per figure (median taken)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON output path")
    args = parser.parse_args()
    bs, runs = args.block_size, args.runs
    results = {
        "block_size": bs,
        "runs": runs,
        "prompt_2048_full_hit": bench_prompt(bs, runs, 2048, hit=True),
        "prompt_2048_miss": bench_prompt(bs, runs, 2048, hit=False),
        "shared_prefix_256x1024": bench_shared_prefix(bs, max(3, runs // 2), 256, 1024, 1024),
        "hashing": bench_hashing(bs, runs, 1 << 20),
    }
    rows = [
        (
            "2,048-token prompt, full-prefix hit",
            f"{results['prompt_2048_full_hit']['median_us']:.1f} us",
        ),
        ("2,048-token prompt, miss", f"{results['prompt_2048_miss']['median_us']:.1f} us"),
        (
            "256 seqs x (1,024 shared + 1,024 own)",
            f"{results['shared_prefix_256x1024']['median_ms']:.2f} ms",
        ),
        ("extend_block_hashes", f"{results['hashing']['tokens_per_s'] / 1e6:.2f} M tokens/s"),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"{'benchmark (block_size ' + str(bs) + ')':<{width}}  median")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
