"""GPU check of the Triton kernels: correctness vs torch, decode HBM bandwidth, extend time, engine.

Workload (one NVIDIA H200, under 8 minutes):
  1. correctness, bf16 and fp16: decode, prefix-extend and the mixed-batch backend forward against
     a dense fp32 torch reference over the same paged cache (error = max|out-ref| / max|ref|);
  2. decode attention, Qwen3-0.6B attention shape (16 heads, 8 KV heads, head_dim 128, bf16,
     block_size 16, shuffled blocks) at batch 1/32/256 x context 1k/8k/32k: time and achieved
     bandwidth = K/V bytes read / time, as a fraction of --peak-gbps (baseline: the H200's 4.8 TB/s);
     a small sweep of tile size / warps / splits at the longest contexts;
  3. prefix-extend attention: chunks of new tokens over long cached prefixes (time, TFLOP/s);
  4. end-to-end engine: a random-weight model shaped like Qwen3-0.6B, 256 sequences with input and
     output lengths uniform in 100..1024 (ignore_eos), attention_backend="triton", bf16.

``--dry-run`` runs every path on CPU with tiny shapes through Triton's interpreter. Prints one table
and writes JSON (benchmarks/results/gpu_check.json unless --out).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path
from typing import Any

import torch

Row = dict[str, Any]
QWEN3_06B = {
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 128,
    "vocab_size": 512,
    "tie_word_embeddings": True,
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreter")
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="peak HBM bandwidth in GB/s")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu_check.json")
    p.add_argument("--engine-seqs", type=int, default=256, help="sequences in the engine section")
    p.add_argument("--skip-engine", action="store_true", help="kernel sections only")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def paged_cache(
    batch: int,
    ctx: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[2, num_blocks, block_size, kv_heads, head_dim]`` cache holding ``batch`` contexts of
    ``ctx`` tokens in shuffled blocks, and their block tables."""
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    return kv, perm.view(batch, blocks_per_seq)


def dense_reference(
    q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, seq_len: int, scale: float
) -> torch.Tensor:
    """fp32 causal attention of ``q`` (the last ``len(q)`` positions) over one paged context."""
    block_size = kv.shape[2]
    pos = torch.arange(seq_len, device=q.device)
    blocks = table[pos // block_size].long()
    k = kv[0][blocks, pos % block_size].float()  # [L, Hkv, D]
    v = kv[1][blocks, pos % block_size].float()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    q_pos = seq_len - q.shape[0] + torch.arange(q.shape[0], device=q.device)
    scores = scores.masked_fill(pos[None, :] > q_pos[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def check_correctness(device: torch.device, dtypes: list[torch.dtype], rows: list[Row]) -> None:
    from prefixserve.attention.metadata import SeqSpan, build_attention_metadata
    from prefixserve.attention.triton_backend import TritonAttentionBackend

    heads, kv_heads, head_dim, block_size = 16, 8, 128, 16
    scale = head_dim**-0.5
    ctx_lens = [1, 16, 100, 300]  # context 1, a whole block, ragged; decodes first
    q_lens = [1, 1, 37, 64]
    for dtype in dtypes:
        kv, tables = paged_cache(
            len(ctx_lens), max(ctx_lens), kv_heads, head_dim, block_size, dtype, device
        )
        query = torch.randn(sum(q_lens), heads, head_dim, dtype=dtype, device=device)
        spans = [SeqSpan(t, n - q, q) for t, n, q in zip(tables.tolist(), ctx_lens, q_lens)]
        _, md = build_attention_metadata(spans, block_size, device)
        starts = md.query_start_loc_cpu
        flat = kv.view(2, -1, kv_heads, head_dim)
        key, value = flat[0][md.slot_mapping].clone(), flat[1][md.slot_mapping].clone()
        flat[:, md.slot_mapping] = 0  # the forward must store them before attending
        out = TritonAttentionBackend().forward(query, key, value, kv, md, scale)
        ref = torch.cat(
            [
                dense_reference(query[starts[i] : starts[i + 1]], kv, tables[i], n, scale)
                for i, n in enumerate(ctx_lens)
            ]
        )
        err = rel_err(out, ref)
        tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
        rows.append(
            {
                "section": "correctness",
                "case": f"forward decode+extend {str(dtype)[6:]}",
                "value": err,
                "unit": "max rel err",
                "note": "ok" if err < tol else f"FAIL (tol {tol})",
            }
        )


def bench(fn, device: torch.device) -> float:
    """Milliseconds per call: triton.testing.do_bench on CUDA, one timed call in a dry run."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def decode_bandwidth(device: torch.device, peak_gbps: float, dry: bool, rows: list[Row]) -> None:
    from prefixserve.kernels import decode_attention, default_num_splits

    heads, kv_heads, head_dim, block_size, dtype = 16, 8, 128, 16, torch.bfloat16
    batches, ctxs = ([1, 2], [16, 48]) if dry else ([1, 32, 256], [1024, 8192, 32768])
    if dry:
        heads, kv_heads, head_dim, dtype = 4, 2, 32, torch.float32
    # (block_n, num_warps, split multiplier) tried at the longest context on top of the defaults
    sweep = (
        [(16, 4, 2.0)]
        if dry
        else [(64, 4, 1.0), (128, 4, 1.0), (128, 8, 1.0), (128, 4, 2.0), (256, 8, 1.0)]
    )
    for batch in batches:
        for ctx in ctxs:
            kv_bytes = 2 * batch * ctx * kv_heads * head_dim * torch.finfo(dtype).bits // 8
            if device.type == "cuda" and kv_bytes * 1.2 > torch.cuda.mem_get_info(device)[0]:
                rows.append(
                    {"section": "decode", "case": f"B={batch} ctx={ctx}", "note": "skipped: memory"}
                )
                continue
            kv, tables = paged_cache(batch, ctx, kv_heads, head_dim, block_size, dtype, device)
            q = torch.randn(batch, heads, head_dim, dtype=dtype, device=device)
            seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            out = torch.empty_like(q)
            configs = [(None, None, 1.0)] + (sweep if ctx == ctxs[-1] else [])
            for block_n, warps, split_mult in configs:
                splits = max(1, int(default_num_splits(batch, kv_heads, ctx, device) * split_mult))

                run = partial(
                    decode_attention,
                    q,
                    kv[0],
                    kv[1],
                    tables,
                    seq_lens,
                    head_dim**-0.5,
                    out,
                    ctx,
                    num_splits=splits,
                    block_n=block_n,
                    num_warps=warps,
                )
                ms = bench(run, device)
                gbps = kv_bytes / (ms * 1e-3) / 1e9
                tag = "default" if block_n is None else f"block_n={block_n} warps={warps}"
                rows.append(
                    {
                        "section": "decode",
                        "case": f"B={batch} ctx={ctx} {tag} splits={splits}",
                        "time_ms": ms,
                        "value": gbps,
                        "unit": "GB/s",
                        "note": f"{100 * gbps / peak_gbps:.0f}% of peak",
                    }
                )
            del kv, tables


def extend_timing(device: torch.device, dry: bool, rows: list[Row]) -> None:
    from prefixserve.kernels import extend_attention

    heads, kv_heads, head_dim, block_size, dtype = 16, 8, 128, 16, torch.bfloat16
    cases = [(8, 4096, 512), (16, 0, 1024), (4, 16384, 2048)]  # (seqs, cached prefix, new tokens)
    if dry:
        heads, kv_heads, head_dim, dtype = 4, 2, 32, torch.float32
        cases = [(2, 16, 8), (1, 0, 12)]
    for seqs, prefix, new in cases:
        seq_len = prefix + new
        kv, tables = paged_cache(seqs, seq_len, kv_heads, head_dim, block_size, dtype, device)
        q = torch.randn(seqs * new, heads, head_dim, dtype=dtype, device=device)
        qsl = torch.arange(0, seqs * new + 1, new, dtype=torch.int32, device=device)
        seq_lens = torch.full((seqs,), seq_len, dtype=torch.int32, device=device)
        out = torch.empty_like(q)
        run = partial(
            extend_attention, q, kv[0], kv[1], qsl, seq_lens, tables, new, head_dim**-0.5, out
        )
        ms = bench(run, device)
        visible = seqs * (new * prefix + new * (new + 1) / 2)  # (query, key) pairs attended
        tflops = 4 * visible * heads * head_dim / (ms * 1e-3) / 1e12
        rows.append(
            {
                "section": "extend",
                "case": f"{seqs} seqs prefix={prefix} new={new}",
                "time_ms": ms,
                "value": tflops,
                "unit": "TFLOP/s",
            }
        )
        del kv, tables


def engine_throughput(args: argparse.Namespace, device: torch.device, rows: list[Row]) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from prefixserve import LLM, SamplingParams
    from prefixserve.models.builtin import builtin_tokenizer

    dry = args.dry_run
    shape = TINY if dry else QWEN3_06B
    num_seqs, lo, hi = (3, 8, 24) if dry else (args.engine_seqs, 100, 1024)
    gen = torch.Generator().manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = builtin_tokenizer()
        config = Qwen3Config(**shape, max_position_embeddings=4096, torch_dtype="bfloat16")
        torch.manual_seed(args.seed)
        Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        kwargs = {"device": "cpu", "dtype": "float32"} if dry else {"dtype": "bfloat16"}
        llm = LLM(model=folder, attention_backend="triton", **kwargs)
        vocab = min(len(tokenizer), shape["vocab_size"])
        in_lens = torch.randint(lo, hi + 1, (num_seqs,), generator=gen).tolist()
        out_lens = (
            torch.randint(lo, hi + 1, (num_seqs,), generator=gen).tolist()
            if not dry
            else [4] * num_seqs
        )
        prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in in_lens]
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in out_lens]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    rows.append(
        {
            "section": "engine",
            "case": f"{num_seqs} seqs in/out U({lo},{hi})",
            "time_ms": seconds * 1e3,
            "value": generated / seconds,
            "unit": "output tok/s",
            "note": f"{(generated + sum(in_lens)) / seconds:.0f} total tok/s",
        }
    )


def print_table(rows: list[Row]) -> None:
    print(f"{'section':<12} {'case':<48} {'time_ms':>10} {'value':>12} {'unit':<13} note")
    for r in rows:
        t = f"{r['time_ms']:.3f}" if "time_ms" in r else ""
        v = f"{r['value']:.4g}" if "value" in r else ""
        print(
            f"{r['section']:<12} {r['case']:<48} {t:>10} {v:>12} {r.get('unit', ''):<13} {r.get('note', '')}"
        )


def main() -> None:
    args = parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined, so before import
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run to exercise the code paths on CPU")
    device = torch.device("cpu" if args.dry_run else "cuda")
    torch.manual_seed(args.seed)
    rows: list[Row] = []
    dtypes = [torch.float32, torch.bfloat16] if args.dry_run else [torch.bfloat16, torch.float16]
    sections = [
        ("correctness", lambda: check_correctness(device, dtypes, rows)),
        ("decode", lambda: decode_bandwidth(device, args.peak_gbps, args.dry_run, rows)),
        ("extend", lambda: extend_timing(device, args.dry_run, rows)),
    ]
    if not args.skip_engine:
        sections.append(("engine", lambda: engine_throughput(args, device, rows)))
    for name, run in sections:
        try:
            run()
        except Exception as exc:
            traceback.print_exc()
            rows.append(
                {"section": name, "case": "error", "note": f"{type(exc).__name__}: {exc}"[:200]}
            )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    machine = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else "cpu (dry run, interpreter)"
    )
    print(f"machine: {machine}  peak: {args.peak_gbps:.0f} GB/s")
    print_table(rows)
    long_ctx = [
        r["value"]
        for r in rows
        if r["section"] == "decode"
        and "value" in r
        and f"ctx={32768 if not args.dry_run else 48}" in r["case"]
    ]
    if long_ctx:
        print(
            f"decode at the longest context: best {100 * max(long_ctx) / args.peak_gbps:.0f}% of peak "
            "HBM bandwidth (target >= 70%)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": machine,
                "peak_gbps": args.peak_gbps,
                "dry_run": args.dry_run,
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
