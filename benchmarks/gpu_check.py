"""GPU check of the Triton kernels: correctness vs torch, decode HBM bandwidth, cascade decode,
extend time, the engine eager and with CUDA graphs.

Workload (one NVIDIA H200, under 8 minutes):
  1. correctness, bf16 and fp16: decode, prefix-extend and the mixed-batch backend forward against
     a dense fp32 torch reference over the same paged cache (error = max|out-ref| / max|ref|), and
     the same forward with cascade decode over a shared prefix (TritonAttentionBackend(cascade=True));
  2. decode attention, Qwen3-0.6B attention shape (16 heads, 8 KV heads, head_dim 128, bf16,
     block_size 16, shuffled blocks) at batch 1/32/256 x context 1k/8k/32k: time and achieved
     bandwidth = K/V bytes read / time, as a fraction of --peak-gbps (baseline: the H200's 4.8 TB/s);
     a small sweep of tile size / warps / splits at the longest contexts;
  3. cascade decode against the plain decode kernel (its baseline), same shape, 16/64/256 sequences
     x 1k/8k/32k shared prefix + 128 own tokens each: time, agreement of the two outputs and with
     the dense reference, and bandwidth = the K/V bytes actually needed (the shared prefix once + every
     suffix) / time, as a fraction of peak; whether ``cascade_pays`` would take each case;
  4. prefix-extend attention: chunks of new tokens over long cached prefixes (time, TFLOP/s);
  5. end-to-end engine: a random-weight model shaped like Qwen3-0.6B, 256 sequences with input and
     output lengths uniform in 100..1024 (ignore_eos), attention_backend="triton", bf16, eager
     (enforce_eager=True, the baseline) and with CUDA graphs: output tok/s of each and their ratio,
     each engine warmed up first (a few short requests) so no Triton compile is timed;
     then 32 sequences in fp32, where the two must give the same greedy tokens.

``--dry-run`` runs every path on CPU with tiny shapes through Triton's interpreter (there are no CUDA
graphs on CPU: both engine runs are eager there). Prints one table and writes JSON
(benchmarks/results/gpu_check.json unless --out).
"""

from __future__ import annotations

import argparse
import gc
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


def shared_prefix_cache(
    shared: int,
    own_lens: list[int],
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, list[list[int]]]:
    """A cache whose sequences all start with the same ``shared`` tokens (one physical copy, as
    prefix caching leaves them), then ``own_lens[i]`` tokens in blocks of their own; shuffled."""
    shared_blocks = -(-shared // block_size)
    own_blocks = [-(-n // block_size) for n in own_lens]
    num_blocks = shared_blocks + sum(own_blocks)
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    perm = torch.randperm(num_blocks).tolist()
    head, rest = perm[:shared_blocks], perm[shared_blocks:]
    tables = []
    for n in own_blocks:
        tables.append(head + rest[:n])
        rest = rest[n:]
    return kv, tables


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


def forward_error(
    backend,
    kv: torch.Tensor,
    tables: list[list[int]],
    ctx_lens: list[int],
    q_lens: list[int],
    heads: int,
) -> tuple[float, bool]:
    """The backend's forward of one step (decodes first) against the dense reference, and whether
    it took cascade; the step's K/V are zeroed in the cache first, so the forward must store them
    before attending."""
    from prefixserve.attention.metadata import SeqSpan, build_attention_metadata

    _, _, block_size, kv_heads, head_dim = kv.shape
    scale = head_dim**-0.5
    query = torch.randn(sum(q_lens), heads, head_dim, dtype=kv.dtype, device=kv.device)
    spans = [SeqSpan(t, n - q, q) for t, n, q in zip(tables, ctx_lens, q_lens)]
    _, md = build_attention_metadata(spans, block_size, kv.device)
    starts = md.query_start_loc_cpu
    flat = kv.view(2, -1, kv_heads, head_dim)
    key, value = flat[0][md.slot_mapping].clone(), flat[1][md.slot_mapping].clone()
    flat[:, md.slot_mapping] = 0
    out = backend.forward(query, key, value, kv, backend.plan(md, kv), scale)
    ref = torch.cat(
        [
            dense_reference(
                query[starts[i] : starts[i + 1]],
                kv,
                torch.tensor(tables[i], device=kv.device),
                n,
                scale,
            )
            for i, n in enumerate(ctx_lens)
        ]
    )
    return rel_err(out, ref), md.backend_plan.cascade is not None


def check_correctness(device: torch.device, dtypes: list[torch.dtype], rows: list[Row]) -> None:
    from prefixserve.attention.triton_backend import TritonAttentionBackend

    heads, kv_heads, head_dim, block_size = 16, 8, 128, 16
    ctx_lens = [1, 16, 100, 300]  # context 1, a whole block, ragged; decodes first
    q_lens = [1, 1, 37, 64]
    # cascade: 4 decodes and a prefill chunk over a 320-token shared prefix (one of them decodes
    # the first token after it), and a decode and a prefill in no group
    shared, own = 320, [1, 16, 100, 37, 50, 40, 70]
    casc_ctx = [shared + n for n in own[:5]] + own[5:]
    casc_q = [1, 1, 1, 1, 20, 1, 30]
    for dtype in dtypes:
        kv, tables = paged_cache(
            len(ctx_lens), max(ctx_lens), kv_heads, head_dim, block_size, dtype, device
        )
        plain = TritonAttentionBackend()
        cases = [("forward decode+extend", plain, kv, tables.tolist(), ctx_lens, q_lens)]
        kv2, tables2 = shared_prefix_cache(
            shared, own, kv_heads, head_dim, block_size, dtype, device
        )
        tables2 = tables2[:5] + [t[shared // block_size :] for t in tables2[5:]]
        cascade = TritonAttentionBackend(cascade=True)
        cases.append(("forward cascade+extend", cascade, kv2, tables2, casc_ctx, casc_q))
        tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
        for name, backend, cache, tabs, ctx, ql in cases:
            err, took_cascade = forward_error(backend, cache, tabs, ctx, ql, heads)
            note = "ok" if err < tol else f"FAIL (tol {tol})"
            if took_cascade != (backend is cascade):
                note = "FAIL (cascade plan)"
            rows.append(
                {
                    "section": "correctness",
                    "case": f"{name} {str(dtype)[6:]}",
                    "value": err,
                    "unit": "max rel err",
                    "note": note,
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
    from prefixserve.kernels.decode_attention import decode_attention, default_num_splits

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


def cascade_decode(device: torch.device, peak_gbps: float, dry: bool, rows: list[Row]) -> None:
    """Cascade decode against the plain decode kernel over one shared prefix (section 3)."""
    from prefixserve.kernels.cascade_attention import (
        CascadeGroups,
        cascade_decode_attention,
        cascade_pays,
    )
    from prefixserve.kernels.decode_attention import decode_attention

    heads, kv_heads, head_dim, block_size, dtype = 16, 8, 128, 16, torch.bfloat16
    seq_counts, shared_lens, suffix = [16, 64, 256], [1024, 8192, 32768], 128
    if dry:
        heads, kv_heads, head_dim, dtype = 4, 2, 32, torch.float32
        seq_counts, shared_lens, suffix = [2, 5], [64, 128], 16
    token_bytes = 2 * kv_heads * head_dim * torch.finfo(dtype).bits // 8  # K + V, one layer
    scale = head_dim**-0.5
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for shared in shared_lens:
        for n in seq_counts:
            kv, table_list = shared_prefix_cache(
                shared, [suffix] * n, kv_heads, head_dim, block_size, dtype, device
            )
            tables = torch.tensor(table_list, dtype=torch.int32, device=device)
            seq_len = shared + suffix
            seq_lens = torch.full((n,), seq_len, dtype=torch.int32, device=device)
            q = torch.randn(n, heads, head_dim, dtype=dtype, device=device)
            groups = CascadeGroups.build(
                [(list(range(n)), shared // block_size)],
                tables,
                range(n + 1),
                [seq_len] * n,
                block_size,
            )
            plain_out, casc_out = torch.empty_like(q), torch.empty_like(q)
            plain = partial(
                decode_attention, q, kv[0], kv[1], tables, seq_lens, scale, plain_out, seq_len
            )
            casc = partial(
                cascade_decode_attention,
                q,
                kv[0],
                kv[1],
                tables,
                seq_lens,
                groups,
                scale,
                casc_out,
            )
            plain_ms, casc_ms = bench(plain, device), bench(casc, device)
            agree = rel_err(casc_out, plain_out.float())
            ref_err = max(
                rel_err(
                    casc_out[i : i + 1],
                    dense_reference(q[i : i + 1], kv, tables[i], seq_len, scale),
                )
                for i in (0, n - 1)
            )
            needed = (shared + n * suffix) * token_bytes  # the shared prefix once + every suffix
            pays = cascade_pays(n, shared, [suffix] * n, token_bytes)
            for name, ms in (("plain", plain_ms), ("cascade", casc_ms)):
                gbps = needed / (ms * 1e-3) / 1e9
                note = f"{100 * gbps / peak_gbps:.0f}% of peak"
                if name == "plain":
                    note += f"; reads {n * seq_len * token_bytes / needed:.1f}x the needed bytes"
                else:
                    ok = agree < tol and ref_err < tol
                    note += (
                        f"; {plain_ms / ms:.2f}x plain; err {agree:.1e} vs plain, "
                        f"{ref_err:.1e} vs dense{'' if ok else ' FAIL'}; pays={'yes' if pays else 'no'}"
                    )
                rows.append(
                    {
                        "section": "cascade",
                        "case": f"N={n} shared={shared} suffix={suffix} {name}",
                        "time_ms": ms,
                        "value": gbps,
                        "unit": "GB/s needed",
                        "note": note,
                    }
                )
            del kv, tables


def extend_timing(device: torch.device, dry: bool, rows: list[Row]) -> None:
    from prefixserve.kernels.extend_attention import extend_attention

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


def engine_generate(
    folder: str, dtype: str, enforce_eager: bool, dry: bool, prompts, params, warm: bool = False
):
    """One engine over ``folder``: (output token ids per prompt, seconds, whether graphs ran).
    The engine is shut down and its memory released before the next one is built.

    ``warm``: before the timer starts, a few of the prompts run a few steps (then the prefix
    cache is emptied), so Triton's compiles land outside the timed run for both engines alike
    (the graph engine's decode kernels already compiled during capture; its prefill ones not).
    """
    from prefixserve import LLM, SamplingParams

    kwargs = (
        {"device": "cpu"} if dry else {"enforce_eager": enforce_eager, "kv_cache_memory_gb": 48}
    )
    llm = LLM(model=folder, attention_backend="triton", dtype=dtype, **kwargs)
    graphs = not dry and llm.llm_engine.runner.graphs is not None
    if warm:
        llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)  # fmt: skip
        llm.reset_prefix_cache()
        if not dry:
            torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    if not dry:
        torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs], seconds, graphs


def engine_throughput(args: argparse.Namespace, device: torch.device, rows: list[Row]) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from prefixserve import SamplingParams
    from prefixserve.models.builtin import builtin_tokenizer

    dry = args.dry_run
    shape = TINY if dry else QWEN3_06B
    num_seqs, lo, hi = (3, 8, 24) if dry else (args.engine_seqs, 100, 1024)
    gen = torch.Generator().manual_seed(args.seed)
    tokenizer = builtin_tokenizer()
    vocab = min(len(tokenizer), shape["vocab_size"])

    def workload(count: int, lo: int, hi: int, out_lens: list[int] | None):
        in_lens = torch.randint(lo, hi + 1, (count,), generator=gen).tolist()
        if out_lens is None:
            out_lens = torch.randint(lo, hi + 1, (count,), generator=gen).tolist()
        prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in in_lens]
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in out_lens]
        return prompts, params, sum(in_lens)

    with tempfile.TemporaryDirectory() as folder:
        config = Qwen3Config(**shape, max_position_embeddings=4096, torch_dtype="bfloat16")
        torch.manual_seed(args.seed)
        Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        # throughput, bf16: eager (the baseline) then CUDA graphs, the same requests
        prompts, params, prompt_tokens = workload(num_seqs, lo, hi, [4] * num_seqs if dry else None)
        dtype = "float32" if dry else "bfloat16"
        runs = {}
        for eager in (True, False):
            tokens, seconds, graphs = engine_generate(
                folder, dtype, eager, dry, prompts, params, warm=True
            )
            runs[eager] = (tokens, seconds)
            generated = sum(len(t) for t in tokens)
            mode = "eager" if eager else "CUDA graphs" if graphs else "graphs off (CPU: eager)"
            note = f"{(generated + prompt_tokens) / seconds:.0f} total tok/s"
            if not eager:
                note += f"; {runs[True][1] / seconds:.2f}x eager"
            rows.append(
                {
                    "section": "engine",
                    "case": f"{num_seqs} seqs in/out U({lo},{hi}) {mode}",
                    "time_ms": seconds * 1e3,
                    "value": generated / seconds,
                    "unit": "output tok/s",
                    "note": note,
                }
            )
        same = sum(a == b for a, b in zip(runs[True][0], runs[False][0]))
        rows.append(
            {
                "section": "engine",
                "case": f"{dtype} outputs, graphs == eager",
                "value": same / num_seqs,
                "unit": "fraction",
                "note": "informational: random bf16 weights leave near-ties that rounding flips",
            }
        )
        # equality, fp32: the graphs must give the eager greedy tokens
        count, out_len = (3, 4) if dry else (32, 64)
        prompts, params, _ = workload(
            count, 8 if dry else 16, 24 if dry else 256, [out_len] * count
        )
        eager_tokens, _, _ = engine_generate(folder, "float32", True, dry, prompts, params)
        graph_tokens, _, graphs = engine_generate(folder, "float32", False, dry, prompts, params)
        same = sum(a == b for a, b in zip(eager_tokens, graph_tokens))
        rows.append(
            {
                "section": "engine",
                "case": f"fp32 tokens, graphs == eager ({count} x {out_len})",
                "value": same / count,
                "unit": "fraction",
                "note": ("ok" if same == count else "FAIL")
                + ("" if graphs or dry else " (graphs were off)"),
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
        ("cascade", lambda: cascade_decode(device, args.peak_gbps, args.dry_run, rows)),
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
