"""Offline decode: tokens/s per weight scheme and engine variant, compile time per bucket, resident
memory and weight bytes.

    python benchmarks/decode offline [--model smollm2] [--schemes float32 int8 int4 gguf]
        [--variants compiled eager batch-invariant float-activations] [--streams 1 8]
        [--max-tokens 64] [--rounds 5] [--threads 2]

Workload: ``common.decode_rate``: N streams (``--streams``) with distinct 32-token prompts, greedy,
EOS ignored, ``--max-tokens`` tokens each, admitted at once into ``LLM``'s engine; tokens/s over
the decode-only steps. Every (scheme, variant) engine lives in this process and they take turns
within each of ``--rounds`` rounds, so a busy minute hits all of them; reported: the median round.
Schemes: ``float32`` (the GGUF dequantized), ``int8`` / ``int4`` (``--quantization``), ``gguf``
(the file's types kept). Variants: ``compiled`` (the default engine), ``eager``
(``--enforce-eager``), ``batch-invariant`` (``--batch-invariant``: its cost),
``float-activations`` (``--activation-quantization none``: int8 / int4 weights times float32
activations, the cost of the integer path's absence).

Memory and compile time come first, each (scheme, variant) in a fresh process: the seconds each
compiled bucket took (``EngineStats.decode_replay``), the resident memory once loaded and after a
short decode, and the bytes of every tensor the model holds, also as a share of float32's.
Machine: this one, CPU, ``--threads`` torch threads. Baseline: the ``eager`` variant and
``float32``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from decode.common import (
    SCHEMES,
    VARIANTS,
    decode_rate,
    rss_bytes,
    set_threads,
    weight_bytes,
    write,
)
from prefixserve import LLM

KV_BLOCKS = 256


def memory_worker(model: str, scheme: str, variant: str, threads: int) -> dict:
    """In a fresh process: load, decode a little, report memory and compile figures."""
    set_threads(threads)
    before = rss_bytes()
    llm = LLM(model, num_kv_blocks=KV_BLOCKS, **SCHEMES[scheme], **VARIANTS[variant])
    loaded = rss_bytes()
    decode_rate(llm, 8, 8)
    replay = llm.llm_engine.stats().decode_replay
    return {
        "weight_bytes": weight_bytes(llm),
        "rss_loaded_bytes": loaded - before,
        "rss_after_decode_bytes": rss_bytes() - before,
        "compile_seconds": replay["capture_seconds"] if replay else {},
    }


def memory_pass(args: argparse.Namespace) -> dict:
    here = Path(__file__).resolve().parent.parent
    figures = {}
    for scheme in args.schemes:
        for variant in args.variants:
            cmd = [sys.executable, "-c",
                   f"import sys; sys.path.insert(0, {str(here)!r}); import json; "
                   "from decode.offline import memory_worker; "
                   f"print(json.dumps(memory_worker({args.model!r}, {scheme!r}, {variant!r}, "
                   f"{args.threads})))"]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            figures[f"{scheme}/{variant}"] = json.loads(out.strip().splitlines()[-1])
    return figures


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    parser.add_argument("--variants", nargs="+", default=["compiled", "eager"],
                        choices=list(VARIANTS))  # fmt: skip
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory pass")
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args(argv)
    memory = {} if args.no_memory else memory_pass(args)
    set_threads(args.threads)
    engines = {(s, v): LLM(args.model, num_kv_blocks=KV_BLOCKS, **SCHEMES[s], **VARIANTS[v])
               for s in args.schemes for v in args.variants}  # fmt: skip
    for llm in engines.values():
        decode_rate(llm, 1, 4)  # warm-up
    runs: dict[str, dict[int, list]] = {f"{s}/{v}": {n: [] for n in args.streams}
                                        for s, v in engines}  # fmt: skip
    for _ in range(args.rounds):  # every engine in turn, each round
        for (s, v), llm in engines.items():
            for n in args.streams:
                runs[f"{s}/{v}"][n].append(decode_rate(llm, n, args.max_tokens))
    rows = []
    for key, by_streams in runs.items():
        for n, results in by_streams.items():
            rates = [r for r, _, _ in results]
            phases = {p: statistics.median(ph[p] for _, _, ph in results) for p in results[0][2]}
            rows.append({"engine": key, "streams": n, "tokens_per_s": statistics.median(rates),
                         "rounds": rates, "ms_per_step": phases})  # fmt: skip
    base = {r["streams"]: r["tokens_per_s"] for r in rows if r["engine"].endswith("/eager")}
    f32 = memory.get(f"float32/{args.variants[0]}", {}).get("weight_bytes")
    print(
        "| engine | streams | tok/s (median of rounds) | vs eager | ms per step: forward / sample |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['tokens_per_s'] / base[r['streams']]:.2f}x" if r["streams"] in base else "-"
        ms = r["ms_per_step"]
        print(f"| {r['engine']} | {r['streams']} | {r['tokens_per_s']:.1f} | {ratio} | "
              f"{ms['forward']:.1f} / {ms['sample']:.1f} |")  # fmt: skip
    for key, m in memory.items():
        share = f", {m['weight_bytes'] / f32:.2f}x float32's" if f32 else ""
        compiled = ", ".join(f"{b}: {s:.1f} s" for b, s in m["compile_seconds"].items()) or "-"
        print(f"{key}: weights {m['weight_bytes'] / 2**20:.0f} MiB{share}; resident "
              f"{m['rss_loaded_bytes'] / 2**20:.0f} MiB loaded, "
              f"{m['rss_after_decode_bytes'] / 2**20:.0f} MiB after decoding; compile {compiled}")  # fmt: skip
    result = {"mode": "offline", "model": args.model, "threads": args.threads,
              "max_tokens": args.max_tokens, "rounds": args.rounds, "rows": rows,
              "memory": memory}  # fmt: skip
    write(args.out_dir, "decode_offline.json", result)
    return result
